//! torch.distributed's collectives as callers name them, and what each
//! engine runs: the names both engines take (`"allreduce"`, ...), the
//! reductions (`"sum"`, ..., `"avg"`), the checks a call passes before it
//! is queued (equal blocks, a root among the ranks, an average that has a
//! meaning), and the operations they become: a CPU engine job's
//! [`Collective`] or the device engine's [`DeviceCollective`].

use super::dtype::{DType, ReduceOp};
use super::transport::OpKind;
use crate::error::{CollectiveError, Result};

/// What a job does with its buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Collective {
    /// Sum over ranks; divide by the world size first when `average`
    /// (DDP's gradient averaging, done before the sum so half types
    /// cannot overflow).
    Allreduce { average: bool },
    /// Copy `root`'s buffer to every rank.
    Broadcast { root: usize },
    /// Wait for every rank (the buffer is ignored).
    Barrier,
    /// torch.distributed's allreduce: `op` over the world transport alone
    /// (no compression, Top-K or 2D: exact results), in the ring's order;
    /// with `mean`, the sum is then divided by the world size (integers
    /// round the quotient toward zero).
    AllreduceOp { op: ReduceOp, mean: bool },
    /// Reduce with `op` into this rank's equal shard of the buffer (the
    /// rest is scratch): torch's reduce-scatter when the buffer holds one
    /// block per rank. With `mean`, this rank's shard is then divided by
    /// the world size, as `AllreduceOp`'s is.
    ReduceScatter { op: ReduceOp, mean: bool },
    /// Every rank's equal shard of the buffer to every rank.
    Allgather,
    /// Block `j` of every rank's buffer to rank `j` (equal blocks).
    AllToAll,
}

impl Collective {
    pub(crate) fn kind(self) -> OpKind {
        match self {
            Collective::Allreduce { .. } | Collective::AllreduceOp { .. } => OpKind::Allreduce,
            Collective::Broadcast { .. } => OpKind::Broadcast,
            Collective::Barrier => OpKind::Barrier,
            Collective::ReduceScatter { .. } => OpKind::ReduceScatter,
            Collective::Allgather => OpKind::Allgather,
            Collective::AllToAll => OpKind::AllToAll,
        }
    }

    /// The reduction, for collectives that reduce.
    pub(crate) fn reduce_op(self) -> Option<ReduceOp> {
        match self {
            Collective::Allreduce { .. } => Some(ReduceOp::Sum),
            Collective::AllreduceOp { op, .. } | Collective::ReduceScatter { op, .. } => Some(op),
            _ => None,
        }
    }
}

/// torch.distributed's collectives the device engine runs
/// (`DeviceChannels::collective`); the rest stay with NCCL.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceCollective {
    /// A sum over every rank, divided by the world size with `mean`.
    Allreduce { mean: bool },
    /// This rank's block of the sum, divided with `mean`.
    ReduceScatter { mean: bool },
    /// Every rank's block to every rank.
    Allgather,
}

/// A collective by the name callers give it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CollectiveName {
    Allreduce,
    ReduceScatter,
    Allgather,
    AllToAll,
    Broadcast,
    Barrier,
}

impl CollectiveName {
    /// Every name, in the order messages list them.
    pub const ALL: [CollectiveName; 6] = [
        CollectiveName::Allreduce,
        CollectiveName::ReduceScatter,
        CollectiveName::Allgather,
        CollectiveName::AllToAll,
        CollectiveName::Broadcast,
        CollectiveName::Barrier,
    ];

    /// The name callers use.
    pub fn name(self) -> &'static str {
        match self {
            CollectiveName::Allreduce => "allreduce",
            CollectiveName::ReduceScatter => "reduce_scatter",
            CollectiveName::Allgather => "allgather",
            CollectiveName::AllToAll => "alltoall",
            CollectiveName::Broadcast => "broadcast",
            CollectiveName::Barrier => "barrier",
        }
    }

    /// Whether the buffer holds one equal block per rank.
    pub fn sharded(self) -> bool {
        matches!(
            self,
            CollectiveName::ReduceScatter | CollectiveName::Allgather | CollectiveName::AllToAll
        )
    }
}

/// The engine a collective is called on, which decides what it takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Runner {
    /// The CPU engine: every collective, every [`ReduceOp`] and `avg`.
    Host,
    /// The device engine: allreduce, reduce-scatter and allgather, with
    /// `sum` or `avg`.
    Device,
}

impl Runner {
    /// The collectives it runs.
    pub fn collectives(self) -> &'static [CollectiveName] {
        match self {
            Runner::Host => &CollectiveName::ALL,
            Runner::Device => &CollectiveName::ALL[..3],
        }
    }

    /// `"a, b or c"`: the collectives it runs, for a message.
    fn expected(self) -> String {
        let names: Vec<&str> = self.collectives().iter().map(|c| c.name()).collect();
        match names.split_last() {
            Some((last, [])) => last.to_string(),
            Some((last, rest)) => format!("{} or {last}", rest.join(", ")),
            None => String::new(),
        }
    }
}

/// A reduction as callers name it: `op`, then with `mean` the result
/// divided by the world size (`"avg"`, `"mean"` or `"average"`: a sum).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Reduce {
    pub op: ReduceOp,
    pub mean: bool,
}

impl Reduce {
    /// The names the CPU engine takes: every [`ReduceOp`]'s, then `"avg"`.
    pub fn names() -> Vec<&'static str> {
        let mut names: Vec<&'static str> = ReduceOp::ALL.iter().map(|op| op.name()).collect();
        names.push("avg");
        names
    }

    /// `name` (any case, spaces around it ignored) as `runner` takes it.
    pub fn parse(runner: Runner, name: &str) -> Result<Self> {
        let name = name.trim().to_ascii_lowercase();
        let (op, mean) = match (runner, name.as_str()) {
            (_, "avg" | "mean" | "average") => (ReduceOp::Sum, true),
            (Runner::Host, other) => (ReduceOp::parse(other)?, false),
            (Runner::Device, "sum") => (ReduceOp::Sum, false),
            (Runner::Device, other) => {
                return Err(CollectiveError::DeviceReduce(other.to_string()).into())
            }
        };
        Ok(Reduce { op, mean })
    }
}

/// One call of a collective by name, parsed for the engine that runs it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CollectiveCall {
    pub runner: Runner,
    pub name: CollectiveName,
    pub reduce: Reduce,
}

impl CollectiveCall {
    /// `collective` with the reduction `reduce` (ignored by those that do
    /// not reduce, but parsed first all the same), as `runner` takes them.
    pub fn parse(runner: Runner, collective: &str, reduce: &str) -> Result<Self> {
        let reduce = Reduce::parse(runner, reduce)?;
        let name = runner
            .collectives()
            .iter()
            .copied()
            .find(|c| c.name() == collective)
            .ok_or_else(|| CollectiveError::Unknown {
                name: collective.to_string(),
                expected: runner.expected(),
            })?;
        Ok(CollectiveCall {
            runner,
            name,
            reduce,
        })
    }

    /// Checks a buffer of `bytes` bytes of `dtype` elements across `size`
    /// ranks: one equal block per rank where the collective splits it, and
    /// (on the CPU engine) an average only of types that have one.
    pub fn check(&self, dtype: DType, bytes: usize, size: usize) -> Result<()> {
        let elements = bytes / dtype.size();
        if self.name.sharded() && elements % size != 0 {
            return Err(CollectiveError::UnequalBlocks {
                collective: self.name.name(),
                elements,
                dtype: dtype.name(),
                size,
            }
            .into());
        }
        if self.runner == Runner::Host {
            check_average(self.reduce.mean, dtype)?;
        }
        Ok(())
    }

    /// The CPU engine's job (`root` for a broadcast, among `size` ranks).
    pub fn job(&self, root: usize, size: usize) -> Result<Collective> {
        let Reduce { op, mean } = self.reduce;
        Ok(match self.name {
            CollectiveName::Allreduce => Collective::AllreduceOp { op, mean },
            CollectiveName::ReduceScatter => Collective::ReduceScatter { op, mean },
            CollectiveName::Allgather => Collective::Allgather,
            CollectiveName::AllToAll => Collective::AllToAll,
            CollectiveName::Broadcast => {
                check_root(root, size)?;
                Collective::Broadcast { root }
            }
            CollectiveName::Barrier => Collective::Barrier,
        })
    }

    /// The device engine's collective (an error for one it does not run).
    pub fn device(&self) -> Result<DeviceCollective> {
        let mean = self.reduce.mean;
        Ok(match self.name {
            CollectiveName::Allreduce => DeviceCollective::Allreduce { mean },
            CollectiveName::ReduceScatter => DeviceCollective::ReduceScatter { mean },
            CollectiveName::Allgather => DeviceCollective::Allgather,
            other => {
                return Err(CollectiveError::Unknown {
                    name: other.name().to_string(),
                    expected: Runner::Device.expected(),
                }
                .into())
            }
        })
    }
}

/// `root` must be one of `size` ranks.
pub fn check_root(root: usize, size: usize) -> Result<()> {
    if root >= size {
        return Err(CollectiveError::NotARank { root, size }.into());
    }
    Ok(())
}

/// An average (`mean`) only of element types that have one (not bool).
pub fn check_average(mean: bool, dtype: DType) -> Result<()> {
    if mean && !dtype.averages() {
        return Err(CollectiveError::NoAverage {
            dtype: dtype.name(),
        }
        .into());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn message(e: crate::error::Error) -> String {
        e.to_string()
    }

    #[test]
    fn names_parse_for_each_engine_with_their_messages() {
        let call = CollectiveCall::parse(Runner::Host, "reduce_scatter", " AVG ").unwrap();
        assert_eq!(call.name, CollectiveName::ReduceScatter);
        assert_eq!(
            call.reduce,
            Reduce {
                op: ReduceOp::Sum,
                mean: true
            }
        );
        assert_eq!(
            call.job(0, 2).unwrap(),
            Collective::ReduceScatter {
                op: ReduceOp::Sum,
                mean: true
            }
        );
        let max = CollectiveCall::parse(Runner::Host, "allreduce", "max").unwrap();
        assert_eq!(max.reduce.op, ReduceOp::Max);
        assert_eq!(
            message(CollectiveCall::parse(Runner::Host, "scan", "sum").unwrap_err()),
            "unknown collective \"scan\": expected allreduce, reduce_scatter, allgather, \
             alltoall, broadcast or barrier"
        );
        assert_eq!(
            message(CollectiveCall::parse(Runner::Device, "alltoall", "sum").unwrap_err()),
            "unknown collective \"alltoall\": expected allreduce, reduce_scatter or allgather"
        );
        assert_eq!(
            message(CollectiveCall::parse(Runner::Device, "allreduce", "Max").unwrap_err()),
            "the device engine reduces with sum or avg, not \"max\""
        );
        assert!(
            message(CollectiveCall::parse(Runner::Host, "allreduce", "xor").unwrap_err())
                .starts_with("unsupported reduce op \"xor\"")
        );
        let device = CollectiveCall::parse(Runner::Device, "allgather", "mean").unwrap();
        assert_eq!(device.device().unwrap(), DeviceCollective::Allgather);
        let host = CollectiveCall::parse(Runner::Host, "barrier", "sum").unwrap();
        assert!(message(host.device().unwrap_err()).starts_with("unknown collective \"barrier\""));
        assert_eq!(Reduce::names(), ["sum", "product", "min", "max", "avg"]);
    }

    #[test]
    fn checks_keep_their_messages() {
        let gather = CollectiveCall::parse(Runner::Host, "allgather", "sum").unwrap();
        assert!(gather.check(DType::F32, 16, 4).is_ok());
        assert_eq!(
            message(gather.check(DType::F32, 12, 2).unwrap_err()),
            "allgather: 3 float32 elements do not split into 2 equal blocks"
        );
        let whole = CollectiveCall::parse(Runner::Host, "allreduce", "sum").unwrap();
        assert!(whole.check(DType::F32, 12, 2).is_ok());
        let mean = CollectiveCall::parse(Runner::Host, "allreduce", "avg").unwrap();
        assert_eq!(
            message(mean.check(DType::Bool, 4, 2).unwrap_err()),
            "allreduce: an average of bool elements has no meaning"
        );
        let device = CollectiveCall::parse(Runner::Device, "allreduce", "avg").unwrap();
        assert!(device.check(DType::Bool, 4, 2).is_ok());
        let broadcast = CollectiveCall::parse(Runner::Host, "broadcast", "sum").unwrap();
        assert_eq!(
            message(broadcast.job(2, 2).unwrap_err()),
            "root 2 is not a rank of a group of 2"
        );
        assert_eq!(
            broadcast.job(1, 2).unwrap(),
            Collective::Broadcast { root: 1 }
        );
    }
}
