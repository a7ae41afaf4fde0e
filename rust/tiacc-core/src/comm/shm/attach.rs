//! Forming a group: whether the members share a host, and the mapping
//! member 0 creates for them.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::segment::{create_file, map_and_close, open_file, Segment};
use super::{ShmGroup, MAGIC, MAX_MEMBERS};
use crate::comm::tcp::TcpRing;
use crate::comm::transport::{Deadline, Failed, Transport};
use crate::error::{Error, Result};

/// Where a member runs, as far as sharing memory goes. Members that agree
/// on all three parts see the same `/dev/shm` and each other's process ids.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
struct Whereabouts {
    /// The machine (its boot id) and the network namespace: nodes emulated
    /// with network namespaces on one machine stay apart, as real nodes
    /// are.
    node: u64,
    /// The process-id namespace: a member checks that the others live.
    pids: u64,
    /// The `/dev/shm` file system itself (device and inode), not the mount
    /// namespace: `ip netns exec` and some launchers give every process a
    /// mount namespace of its own over the same `/dev/shm`, while a
    /// container with a private one has another device.
    shm: u64,
}

impl Whereabouts {
    const BYTES: usize = 24;

    fn here() -> Self {
        let link = |ns: &str| {
            std::fs::read_link(ns)
                .map(|p| p.display().to_string())
                .unwrap_or_default()
        };
        let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap_or_default();
        let shm = std::fs::metadata("/dev/shm")
            .map(|m| {
                use std::os::unix::fs::MetadataExt;
                format!("{}:{}", m.dev(), m.ino())
            })
            .unwrap_or_default();
        Whereabouts {
            node: fingerprint(&format!("{boot}|{}", link("/proc/self/ns/net"))),
            // `why_apart` compares `node` first: the other two need no boot id.
            pids: fingerprint(&link("/proc/self/ns/pid")),
            shm: fingerprint(&shm),
        }
    }

    fn write(&self, out: &mut [u8]) {
        for (i, part) in [self.node, self.pids, self.shm].into_iter().enumerate() {
            out[8 * i..8 * (i + 1)].copy_from_slice(&part.to_le_bytes());
        }
    }

    fn read(from: &[u8]) -> Self {
        let part =
            |i: usize| u64::from_le_bytes(from[8 * i..8 * (i + 1)].try_into().unwrap_or([0; 8]));
        Whereabouts {
            node: part(0),
            pids: part(1),
            shm: part(2),
        }
    }

    /// Why members placed as `all` (world ranks `ranks`) cannot share
    /// memory, if they cannot. Members on other nodes are the usual case
    /// (2D, several nodes); the others are a setup the user may want to
    /// change, so the message names two ranks involved.
    fn why_apart(all: &[Whereabouts], ranks: &[usize]) -> Option<String> {
        let first = all[0];
        if all.iter().any(|w| w.node != first.node) {
            return Some(NOT_ONE_HOST.into());
        }
        let apart = |what: &str, same: &dyn Fn(&Whereabouts) -> bool| {
            all.iter().position(|w| !same(w)).map(|m| {
                format!(
                    "ranks {} and {} run on one host but see {what}",
                    ranks[0], ranks[m]
                )
            })
        };
        apart(
            "different /dev/shm file systems (containers need a shared one, \
             e.g. docker --ipc=host)",
            &|w| w.shm == first.shm,
        )
        .or_else(|| {
            apart(
                "different process-id namespaces (containers need a shared one, \
                 e.g. docker --pid=host)",
                &|w| w.pids == first.pids,
            )
        })
    }
}

/// Why a group spanning nodes keeps TCP; not worth a message.
pub(crate) const NOT_ONE_HOST: &str = "its members are not all on one host";

/// FNV-1a: a stable fingerprint, not a security measure.
fn fingerprint(text: &str) -> u64 {
    text.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// Forms the shared-memory group over `ring`'s members when they are all
/// on this host, else returns the ring. Every member returns the same kind.
/// `reason` receives why shared memory was not used, when it was wanted.
pub fn attach(
    mut ring: TcpRing,
    deadline: Deadline,
    reason: &mut Option<String>,
) -> Result<Box<dyn Transport>> {
    let size = ring.size();
    if !(2..=MAX_MEMBERS).contains(&size) {
        return Ok(Box::new(ring));
    }
    let rank = ring.rank();
    // 1. Who is where: whereabouts, process id and address of every member.
    const WHO: usize = 96;
    const PID: usize = Whereabouts::BYTES;
    const HOST: usize = PID + 8;
    let mut who = vec![0u8; WHO * size];
    {
        let mine = &mut who[WHO * rank..WHO * (rank + 1)];
        Whereabouts::here().write(mine);
        mine[PID..PID + 4].copy_from_slice(&(std::process::id() as i32).to_le_bytes());
        let host = ring.local_host();
        let n = host.len().min(WHO - HOST);
        mine[HOST..HOST + n].copy_from_slice(&host.as_bytes()[..n]);
    }
    ring.allgather(&mut who, WHO, deadline)?;
    let places: Vec<Whereabouts> = who.chunks_exact(WHO).map(Whereabouts::read).collect();
    if let Some(why) = Whereabouts::why_apart(&places, ring.members()) {
        *reason = Some(why);
        return Ok(Box::new(ring));
    }
    let pids: Vec<i32> = who
        .chunks_exact(WHO)
        .map(|c| i32::from_le_bytes(c[PID..PID + 4].try_into().unwrap_or([0; 4])))
        .collect();
    let hosts: Vec<String> = who
        .chunks_exact(WHO)
        .map(|c| {
            let text = &c[HOST..];
            let end = text.iter().position(|b| *b == 0).unwrap_or(text.len());
            String::from_utf8_lossy(&text[..end]).into_owned()
        })
        .collect();

    // 2. Member 0 creates the file and sends its name (empty: failed).
    let mut name = [0u8; 128];
    let mut created = None;
    if rank == 0 {
        match create_file(Segment::layout(size).1) {
            Ok((path, fd)) => {
                let bytes = path.as_bytes();
                name[..bytes.len()].copy_from_slice(bytes);
                created = Some((path, fd));
            }
            Err(why) => *reason = Some(why),
        }
    }
    ring.broadcast(&mut name, 0, deadline)?;
    let len = name.iter().position(|b| *b == 0).unwrap_or(name.len());
    if len == 0 {
        reason.get_or_insert_with(|| "member 0 could not create the shared segment".into());
        return Ok(Box::new(ring));
    }
    let path = String::from_utf8_lossy(&name[..len]).into_owned();

    // 3. Everyone maps it and says whether that worked.
    let mapped = match created {
        Some((_, fd)) => map_and_close(fd, size),
        None => open_file(&path).and_then(|fd| map_and_close(fd, size)),
    };
    let mut oks = vec![0u8; size];
    oks[rank] = u8::from(mapped.is_ok());
    ring.allgather(&mut oks, 1, deadline)?;
    if rank == 0 {
        // Every member has opened it (or given up): the name can go, and the
        // memory is freed when the last member unmaps it, even after a crash.
        let _ = std::fs::remove_file(&path);
    }
    if let Some(bad) = oks.iter().position(|ok| *ok == 0) {
        *reason = Some(match &mapped {
            Err(e) => e.clone(),
            Ok(_) => format!("member {bad} could not map {path}"),
        });
        return Ok(Box::new(ring));
    }
    let seg = mapped.map_err(|e| Error::Comm {
        peer: None,
        message: e,
    })?;
    let mut group = ShmGroup {
        seg: Arc::new(seg),
        rank,
        size,
        channel: ring.channel(),
        pids,
        hosts,
        members: ring.members().to_vec(),
        group: ring.group(),
        barriers: 0,
        pieces: 0,
        agreements: 0,
        regions: Vec::new(),
        shared_runs: 0,
        sharing: true,
        broken: Failed::default(),
        sent: 0,
    };
    if rank == 0 {
        group.seg.u64_at(0).store(MAGIC, Ordering::SeqCst);
    }
    // 4. A first barrier through the mapping proves it is shared.
    group.barrier(deadline)?;
    if group.seg.u64_at(0).load(Ordering::SeqCst) != MAGIC {
        return Err(Error::Comm {
            peer: Some(group.world(0)),
            message: group.ctx("the shared segment does not hold member 0's mark"),
        });
    }
    Ok(Box::new(group))
}

#[cfg(test)]
mod tests {
    use super::{Whereabouts, NOT_ONE_HOST};

    fn at(node: u64, pids: u64, shm: u64) -> Whereabouts {
        Whereabouts { node, pids, shm }
    }

    #[test]
    fn whereabouts_round_trip_and_this_process_agrees_with_itself() {
        let here = Whereabouts::here();
        assert_eq!(here, Whereabouts::here());
        let mut bytes = [0u8; Whereabouts::BYTES];
        here.write(&mut bytes);
        assert_eq!(Whereabouts::read(&bytes), here);
    }

    #[test]
    fn members_apart_are_told_apart_by_what_differs_and_named_by_world_rank() {
        let ranks = [4, 5, 6];
        assert_eq!(Whereabouts::why_apart(&[at(1, 2, 3); 3], &ranks), None);
        let other_node = [at(1, 2, 3), at(1, 2, 3), at(9, 2, 3)];
        assert_eq!(
            Whereabouts::why_apart(&other_node, &ranks).as_deref(),
            Some(NOT_ONE_HOST)
        );
        let other_shm = Whereabouts::why_apart(&[at(1, 2, 3), at(1, 2, 7), at(1, 2, 3)], &ranks)
            .expect("a private /dev/shm keeps them apart");
        assert!(
            other_shm.starts_with("ranks 4 and 5 run on one host")
                && other_shm.contains("/dev/shm"),
            "{other_shm}"
        );
        let other_pids = Whereabouts::why_apart(&[at(1, 2, 3), at(1, 2, 3), at(1, 8, 3)], &ranks)
            .expect("another pid namespace keeps them apart");
        assert!(
            other_pids.starts_with("ranks 4 and 6") && other_pids.contains("process-id"),
            "{other_pids}"
        );
    }
}
