//! Launch detection: how the processes of this job were started (torchrun,
//! Open MPI, SLURM, horovodrun, MPICH, a PMIx launcher) and where they
//! rendezvous.

use super::parse::{bad, parse_usize, read};
use crate::error::{Error, Result};

/// How the processes of this job were launched and where they rendezvous.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LaunchEnv {
    /// `torchrun`, `ray`, `mpirun`, `slurm` or one of the [`OTHER_LAUNCHERS`].
    pub launcher: &'static str,
    pub rank: usize,
    pub world_size: usize,
    pub local_rank: usize,
    /// Ranks on this node, when the launcher says.
    pub local_size: Option<usize>,
    /// Rendezvous host (`MASTER_ADDR`), when known.
    pub master_addr: Option<String>,
    /// Rendezvous port (`MASTER_PORT`), when set.
    pub master_port: Option<u16>,
}

/// Launchers read after torchrun, Open MPI and SLURM, each as `(name, rank,
/// size, local rank, local size)` variables: horovodrun's, MPICH's Hydra
/// and a PMIx launcher's (which shares `PMI_SIZE` with Hydra).
pub const OTHER_LAUNCHERS: [(&str, &str, &str, &str, &str); 3] = [
    (
        "horovodrun",
        "HOROVOD_RANK",
        "HOROVOD_SIZE",
        "HOROVOD_LOCAL_RANK",
        "HOROVOD_LOCAL_SIZE",
    ),
    (
        "mpich",
        "PMI_RANK",
        "PMI_SIZE",
        "MPI_LOCALRANKID",
        "MPI_LOCALNRANKS",
    ),
    (
        "pmix",
        "PMIX_RANK",
        "PMI_SIZE",
        "PMIX_LOCAL_RANK",
        "PMIX_LOCAL_SIZE",
    ),
];

/// Detects the launcher from the environment: torchrun (`RANK`,
/// `WORLD_SIZE`, `LOCAL_RANK`; named `ray` in a Ray worker, which Ray
/// Train gives the same variables: `RAY_RAYLET_PID` set and no
/// `TORCHELASTIC_RUN_ID`), Open MPI (`OMPI_COMM_WORLD_*`), SLURM
/// (`SLURM_PROCID`, `SLURM_NTASKS`, `SLURM_LOCALID`), then the
/// [`OTHER_LAUNCHERS`] (horovodrun's rendezvous address,
/// `HOROVOD_GLOO_RENDEZVOUS_ADDR` and `_PORT`, stands in for `MASTER_ADDR`
/// and `MASTER_PORT`). `Ok(None)` when none of them set this process up.
pub fn launch_env() -> Result<Option<LaunchEnv>> {
    launch_env_from(|name| std::env::var_os(name))
}

/// [`launch_env`] reading through `lookup`.
pub fn launch_env_from(
    lookup: impl Fn(&str) -> Option<std::ffi::OsString>,
) -> Result<Option<LaunchEnv>> {
    let get = |name: &str| read(&lookup, name);
    let count = |name: &str| -> Result<Option<usize>> {
        get(name)?.map(|v| parse_usize(name, &v)).transpose()
    };
    let master_addr = get("MASTER_ADDR")?.map(|v| v.trim().to_string());
    let master_port = get("MASTER_PORT")?
        .map(|v| {
            v.trim()
                .parse::<u16>()
                .ok()
                .filter(|p| *p != 0)
                .ok_or_else(|| bad("MASTER_PORT", &v, "a TCP port number (1-65535)"))
        })
        .transpose()?;

    let found = if let (Some(rank), Some(world)) = (count("RANK")?, count("WORLD_SIZE")?) {
        let local_rank = count("LOCAL_RANK")?.unwrap_or(0);
        let ray = get("RAY_RAYLET_PID")?.is_some() && get("TORCHELASTIC_RUN_ID")?.is_none();
        Some((
            if ray { "ray" } else { "torchrun" },
            "RANK",
            rank,
            world,
            local_rank,
            count("LOCAL_WORLD_SIZE")?,
        ))
    } else if let (Some(rank), Some(world)) = (
        count("OMPI_COMM_WORLD_RANK")?,
        count("OMPI_COMM_WORLD_SIZE")?,
    ) {
        let local_rank = count("OMPI_COMM_WORLD_LOCAL_RANK")?.unwrap_or(0);
        let local_size = count("OMPI_COMM_WORLD_LOCAL_SIZE")?;
        Some((
            "mpirun",
            "OMPI_COMM_WORLD_RANK",
            rank,
            world,
            local_rank,
            local_size,
        ))
    } else if let (Some(rank), Some(world)) = (count("SLURM_PROCID")?, count("SLURM_NTASKS")?) {
        let local_rank = count("SLURM_LOCALID")?.unwrap_or(0);
        let local_size = match get("SLURM_TASKS_PER_NODE")? {
            Some(v) => first_tasks_per_node(&v),
            None => None,
        };
        Some(("slurm", "SLURM_PROCID", rank, world, local_rank, local_size))
    } else {
        other_launcher(&count)?
    };
    let Some((launcher, rank_var, rank, world_size, local_rank, local_size)) = found else {
        return Ok(None);
    };
    if world_size == 0 || rank >= world_size {
        return Err(Error::Config {
            variable: rank_var.to_string(),
            value: rank.to_string(),
            expected: format!("a rank below the world size {world_size}"),
        });
    }
    let master_addr = match (master_addr, launcher) {
        (Some(addr), _) => Some(addr),
        (None, "slurm") => get("SLURM_LAUNCH_NODE_IPADDR")?,
        (None, "horovodrun") => get("HOROVOD_GLOO_RENDEZVOUS_ADDR")?.map(|v| v.trim().to_string()),
        (None, _) => None,
    };
    let master_port = match (master_port, launcher) {
        (None, "horovodrun") => get("HOROVOD_GLOO_RENDEZVOUS_PORT")?
            .map(|v| {
                v.trim()
                    .parse::<u16>()
                    .ok()
                    .filter(|p| *p != 0)
                    .ok_or_else(|| {
                        bad(
                            "HOROVOD_GLOO_RENDEZVOUS_PORT",
                            &v,
                            "a TCP port number (1-65535)",
                        )
                    })
            })
            .transpose()?,
        (port, _) => port,
    };
    Ok(Some(LaunchEnv {
        launcher,
        rank,
        world_size,
        local_rank,
        local_size,
        master_addr,
        master_port,
    }))
}

/// What one of the [`OTHER_LAUNCHERS`] set, the first whose rank variable
/// is set: a rank without its size is an error naming both.
#[allow(clippy::type_complexity)]
fn other_launcher(
    count: &impl Fn(&str) -> Result<Option<usize>>,
) -> Result<
    Option<(
        &'static str,
        &'static str,
        usize,
        usize,
        usize,
        Option<usize>,
    )>,
> {
    for (name, rank_var, size_var, local_rank_var, local_size_var) in OTHER_LAUNCHERS {
        let Some(rank) = count(rank_var)? else {
            continue;
        };
        let Some(world) = count(size_var)? else {
            return Err(Error::Config {
                variable: size_var.to_string(),
                value: String::new(),
                expected: format!("the world size, since {rank_var}={rank} is set"),
            });
        };
        let local_rank = count(local_rank_var)?.unwrap_or(0);
        return Ok(Some((
            name,
            rank_var,
            rank,
            world,
            local_rank,
            count(local_size_var)?,
        )));
    }
    Ok(None)
}

/// SLURM writes `2(x3),1` style task counts; the first node's count is
/// enough for a homogeneous job.
fn first_tasks_per_node(value: &str) -> Option<usize> {
    let first = value.split(',').next()?;
    first.split('(').next()?.trim().parse().ok()
}

#[cfg(test)]
mod tests {
    use super::super::tests::env;
    use super::*;

    #[test]
    fn launchers_are_detected() {
        let t = launch_env_from(env(&[
            ("RANK", "3"),
            ("WORLD_SIZE", "4"),
            ("LOCAL_RANK", "1"),
            ("MASTER_ADDR", "10.0.0.1"),
            ("MASTER_PORT", "29500"),
        ]))
        .unwrap()
        .unwrap();
        assert_eq!(
            (t.launcher, t.rank, t.world_size, t.local_rank),
            ("torchrun", 3, 4, 1)
        );
        assert_eq!(t.master_port, Some(29500));

        // Ray Train sets torchrun's variables in its workers.
        let ray = [("RANK", "1"), ("WORLD_SIZE", "2"), ("RAY_RAYLET_PID", "77")];
        let r = launch_env_from(env(&ray)).unwrap().unwrap();
        assert_eq!((r.launcher, r.rank, r.world_size), ("ray", 1, 2));
        // torchrun started inside a Ray task is torchrun.
        let nested = [&ray[..], &[("TORCHELASTIC_RUN_ID", "x")]].concat();
        let n = launch_env_from(env(&nested)).unwrap().unwrap();
        assert_eq!(n.launcher, "torchrun");

        let m = launch_env_from(env(&[
            ("OMPI_COMM_WORLD_RANK", "5"),
            ("OMPI_COMM_WORLD_SIZE", "16"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "5"),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "8"),
        ]))
        .unwrap()
        .unwrap();
        assert_eq!(
            (m.launcher, m.rank, m.world_size, m.local_rank),
            ("mpirun", 5, 16, 5)
        );
        assert_eq!(m.local_size, Some(8));
        assert_eq!(m.master_addr, None);

        let s = launch_env_from(env(&[
            ("SLURM_PROCID", "2"),
            ("SLURM_NTASKS", "8"),
            ("SLURM_LOCALID", "2"),
            ("SLURM_TASKS_PER_NODE", "4(x2)"),
            ("SLURM_LAUNCH_NODE_IPADDR", "10.1.1.1"),
        ]))
        .unwrap()
        .unwrap();
        assert_eq!((s.launcher, s.rank, s.local_size), ("slurm", 2, Some(4)));
        assert_eq!(s.master_addr.as_deref(), Some("10.1.1.1"));

        let h = launch_env_from(env(&[
            ("HOROVOD_RANK", "2"),
            ("HOROVOD_SIZE", "3"),
            ("HOROVOD_LOCAL_RANK", "0"),
            ("HOROVOD_LOCAL_SIZE", "1"),
            ("HOROVOD_GLOO_RENDEZVOUS_ADDR", "10.2.2.2"),
            ("HOROVOD_GLOO_RENDEZVOUS_PORT", "4000"),
        ]))
        .unwrap()
        .unwrap();
        assert_eq!((h.launcher, h.rank, h.world_size), ("horovodrun", 2, 3));
        assert_eq!(
            (h.master_addr.as_deref(), h.master_port),
            (Some("10.2.2.2"), Some(4000))
        );
        let p = launch_env_from(env(&[("PMIX_RANK", "3"), ("PMI_SIZE", "4")]))
            .unwrap()
            .unwrap();
        assert_eq!(
            (p.launcher, p.rank, p.local_rank, p.local_size),
            ("pmix", 3, 0, None)
        );
        // Open MPI sets PMIx's variables too: its own win.
        let m = launch_env_from(env(&[
            ("OMPI_COMM_WORLD_RANK", "1"),
            ("OMPI_COMM_WORLD_SIZE", "2"),
            ("PMIX_RANK", "1"),
        ]))
        .unwrap()
        .unwrap();
        assert_eq!(m.launcher, "mpirun");

        assert_eq!(launch_env_from(env(&[])).unwrap(), None);
    }

    #[test]
    fn bad_launcher_values_are_errors() {
        let err = launch_env_from(env(&[("RANK", "x"), ("WORLD_SIZE", "2")])).unwrap_err();
        assert!(err.to_string().contains("RANK"));
        let err = launch_env_from(env(&[("RANK", "2"), ("WORLD_SIZE", "2")])).unwrap_err();
        assert!(err.to_string().contains("RANK"));
        let err = launch_env_from(env(&[("MASTER_PORT", "99999")])).unwrap_err();
        assert!(err.to_string().contains("MASTER_PORT"));
        let err = launch_env_from(env(&[("PMI_RANK", "1")])).unwrap_err();
        assert!(err.to_string().contains("PMI_SIZE") && err.to_string().contains("PMI_RANK=1"));
        let err =
            launch_env_from(env(&[("HOROVOD_RANK", "4"), ("HOROVOD_SIZE", "4")])).unwrap_err();
        assert!(err.to_string().contains("HOROVOD_RANK"), "{err}");
    }
}
