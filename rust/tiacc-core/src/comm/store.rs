//! The rendezvous of an engine's set-up: what the ranks exchange, before
//! their rings or communicators form, through a key-value store the whole
//! job shares ([`Store`]; torch's c10d store, in the bindings).
//!
//! [`Rendezvous`] holds every exchange an engine makes there (the TCP
//! addresses and the job token, the NCCL unique ids) and the one rule for
//! waiting on peers: a rank that died or stopped during start-up never
//! publishes its keys, and the timeout then names it.

use std::collections::BTreeSet;
use std::time::Duration;

use super::tcp::random_token;
use crate::error::{Error, Result};

/// A key-value store shared by the ranks of a job.
///
/// Keys are set once per exchange (by the rank that owns them) and read by
/// the others; every call may block on the network.
pub trait Store: Send + Sync {
    /// Sets `key` to `value`.
    fn set(&self, key: &str, value: &[u8]) -> Result<()>;
    /// The value of `key` (waiting for it as the store's own `get` does).
    fn get(&self, key: &str) -> Result<Vec<u8>>;
    /// Blocks until every key in `keys` is set, or fails after `timeout`.
    fn wait(&self, keys: &[String], timeout: Duration) -> Result<()>;
    /// Whether `key` is set now; `false` when the store cannot be reached.
    fn check(&self, key: &str) -> bool;
}

/// The exchanges of one engine's set-up: `store`, under keys that start
/// with `prefix`, for `rank`, waiting at most `timeout` on the others.
#[derive(Clone, Copy)]
pub struct Rendezvous<'a> {
    pub store: &'a dyn Store,
    pub prefix: &'a str,
    pub rank: usize,
    pub timeout: Duration,
}

/// What the ranks exchanged before their TCP rings form: every rank's
/// world address (`ip:port`, indexed by rank), the job token, and with the
/// 2D groups the members' intra-node and inter-node addresses (in
/// [`crate::comm::algo::Layout::intra_members`] and
/// [`crate::comm::algo::Layout::inter_members`] order).
#[derive(Debug, Clone, Copy)]
pub struct TcpPeers<'a> {
    pub addresses: &'a [String],
    pub token: &'a [u8],
    pub intra_addresses: Option<&'a [String]>,
    pub inter_addresses: Option<&'a [String]>,
}

/// What [`Rendezvous::tcp_peers`] collected: owns what a [`TcpPeers`]
/// borrows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TcpExchange {
    pub addresses: Vec<String>,
    pub token: Vec<u8>,
    /// The 2D members' intra-node and inter-node addresses, when this rank
    /// connects the 2D groups.
    pub two_d: Option<(Vec<String>, Vec<String>)>,
}

impl TcpExchange {
    /// The peers as [`super::setup::TcpSetup::connect`] takes them.
    pub fn peers(&self) -> TcpPeers<'_> {
        TcpPeers {
            addresses: &self.addresses,
            token: &self.token,
            intra_addresses: self.two_d.as_ref().map(|(a, _)| a.as_slice()),
            inter_addresses: self.two_d.as_ref().map(|(_, e)| e.as_slice()),
        }
    }
}

/// The NCCL unique ids a rank joins with, one per channel each: the
/// world's, and with the 2D groups the intra-node and inter-node ones.
pub type NcclIdLists = (Vec<Vec<u8>>, Option<(Vec<Vec<u8>>, Vec<Vec<u8>>)>);

impl Rendezvous<'_> {
    /// Waits for `keys` (`owners[i]` publishes `keys[i]`); `what` names the
    /// exchange in the error.
    ///
    /// # Errors
    /// [`Error::CommTimeout`] naming the ranks whose keys are still missing
    /// after the timeout (`peer` is the first of them); the store's own
    /// error when the wait failed with every key present.
    pub fn wait_for(&self, keys: &[String], owners: &[usize], what: &str) -> Result<()> {
        let Err(err) = self.store.wait(keys, self.timeout) else {
            return Ok(());
        };
        let missing: BTreeSet<usize> = keys
            .iter()
            .zip(owners)
            .filter(|(key, _)| !self.store.check(key))
            .map(|(_, &owner)| owner)
            .collect();
        let Some(&first) = missing.first() else {
            return Err(err);
        };
        Err(Error::CommTimeout {
            peer: first,
            message: format!(
                "rank {}: {} did not reach the start-up exchange '{what}' within {} s \
                 (stopped, killed or still starting; see their own output)",
                self.rank,
                ranks_text(&missing),
                seconds_text(self.timeout),
            ),
        })
    }

    /// Publishes this rank's world `address` (and its 2D listeners'
    /// `two_d_addresses`, when it has them), rank 0 the job token; waits
    /// for every rank's, then returns the world's addresses, the token and,
    /// for `two_d_members` (this rank's node and inter-node group), their
    /// 2D addresses. `size` is the number of ranks.
    pub fn tcp_peers(
        &self,
        size: usize,
        address: &str,
        two_d_addresses: Option<(&str, &str)>,
        two_d_members: Option<(&[usize], &[usize])>,
    ) -> Result<TcpExchange> {
        let (prefix, rank) = (self.prefix, self.rank);
        self.store
            .set(&format!("{prefix}/addr/{rank}"), address.as_bytes())?;
        if let Some((intra, inter)) = two_d_addresses {
            self.store
                .set(&format!("{prefix}/intra/{rank}"), intra.as_bytes())?;
            self.store
                .set(&format!("{prefix}/inter/{rank}"), inter.as_bytes())?;
        }
        let token_key = format!("{prefix}/token");
        if rank == 0 {
            self.store.set(&token_key, &random_token()?)?;
        }
        let mut keys: Vec<String> = (0..size).map(|r| format!("{prefix}/addr/{r}")).collect();
        keys.push(token_key.clone());
        let mut owners: Vec<usize> = (0..size).chain([0]).collect();
        if two_d_addresses.is_some() {
            for group in ["intra", "inter"] {
                keys.extend((0..size).map(|r| format!("{prefix}/{group}/{r}")));
                owners.extend(0..size);
            }
        }
        self.wait_for(&keys, &owners, &format!("{prefix}/addr"))?;
        let text = |key: String| -> Result<String> {
            let bytes = self.store.get(&key)?;
            String::from_utf8(bytes).map_err(|_| Error::Comm {
                peer: None,
                message: format!("rank {rank}: the start-up exchange's key {key} is not text"),
            })
        };
        let addresses = (0..size)
            .map(|r| text(format!("{prefix}/addr/{r}")))
            .collect::<Result<Vec<_>>>()?;
        let two_d = match two_d_members {
            None => None,
            Some((intra, inter)) => {
                let read = |group: &str, members: &[usize]| {
                    members
                        .iter()
                        .map(|r| text(format!("{prefix}/{group}/{r}")))
                        .collect::<Result<Vec<_>>>()
                };
                Some((read("intra", intra)?, read("inter", inter)?))
            }
        };
        Ok(TcpExchange {
            addresses,
            token: self.store.get(&token_key)?,
            two_d,
        })
    }

    /// The NCCL unique ids of every communicator this rank joins, `channels`
    /// of each: the world's (made by rank 0), and with `two_d_members` the
    /// node's (made by its first member) and the inter-node group's (made
    /// by its first member). `new_id` makes a fresh id; only a group's
    /// maker calls it.
    pub fn nccl_ids(
        &self,
        channels: usize,
        two_d_members: Option<(&[usize], &[usize])>,
        new_id: &mut dyn FnMut() -> Result<Vec<u8>>,
    ) -> Result<NcclIdLists> {
        let prefix = self.prefix;
        let world = self.ids(&format!("{prefix}/world"), 0, channels, new_id)?;
        let Some((intra, inter)) = two_d_members else {
            return Ok((world, None));
        };
        let (first, second) = match (intra.first(), inter.first()) {
            (Some(&a), Some(&e)) => (a, e),
            _ => {
                return Err(Error::InvalidArgument(
                    "the 2D groups need at least one member each".into(),
                ))
            }
        };
        let intra = self.ids(&format!("{prefix}/intra/{first}"), first, channels, new_id)?;
        let inter = self.ids(
            &format!("{prefix}/inter/{second}"),
            second,
            channels,
            new_id,
        )?;
        Ok((world, Some((intra, inter))))
    }

    /// `n` ids under `prefix`, made by `leader`.
    fn ids(
        &self,
        prefix: &str,
        leader: usize,
        n: usize,
        new_id: &mut dyn FnMut() -> Result<Vec<u8>>,
    ) -> Result<Vec<Vec<u8>>> {
        let keys: Vec<String> = (0..n).map(|c| format!("{prefix}/{c}")).collect();
        if self.rank == leader {
            for key in &keys {
                self.store.set(key, &new_id()?)?;
            }
        }
        self.wait_for(&keys, &vec![leader; n], prefix)?;
        keys.iter().map(|key| self.store.get(key)).collect()
    }
}

/// `rank 3`, or `ranks 1, 2` (ascending).
fn ranks_text(ranks: &BTreeSet<usize>) -> String {
    let list: Vec<String> = ranks.iter().map(usize::to_string).collect();
    match list.as_slice() {
        [one] => format!("rank {one}"),
        _ => format!("ranks {}", list.join(", ")),
    }
}

/// Seconds as `%g` writes them for the timeouts people set: `60`, `0.5`.
fn seconds_text(timeout: Duration) -> String {
    let seconds = timeout.as_secs_f64();
    if seconds.fract() == 0.0 && seconds < 1e6 {
        format!("{}", seconds as u64)
    } else {
        format!("{seconds}")
    }
}

/// A store in memory that threads standing for the ranks share (the tests'
/// stand-in for a c10d store): `get` waits for its key as c10d's does.
#[cfg(test)]
#[derive(Default)]
pub(crate) struct MemoryStore {
    keys: std::sync::Mutex<std::collections::HashMap<String, Vec<u8>>>,
    changed: std::sync::Condvar,
}

#[cfg(test)]
impl MemoryStore {
    /// The keys set so far, sorted.
    pub(crate) fn keys(&self) -> Vec<String> {
        let mut keys: Vec<String> = self.keys.lock().unwrap().keys().cloned().collect();
        keys.sort();
        keys
    }
}

#[cfg(test)]
impl Store for MemoryStore {
    fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        self.keys.lock().unwrap().insert(key.into(), value.into());
        self.changed.notify_all();
        Ok(())
    }

    fn get(&self, key: &str) -> Result<Vec<u8>> {
        self.wait(&[key.to_string()], Duration::from_secs(5))?;
        Ok(self.keys.lock().unwrap()[key].clone())
    }

    fn wait(&self, keys: &[String], timeout: Duration) -> Result<()> {
        let guard = self.keys.lock().unwrap();
        let (_guard, result) = self
            .changed
            .wait_timeout_while(guard, timeout, |k| {
                keys.iter().any(|key| !k.contains_key(key))
            })
            .unwrap();
        if result.timed_out() {
            return Err(Error::Comm {
                peer: None,
                message: "the store's own timeout".into(),
            });
        }
        Ok(())
    }

    fn check(&self, key: &str) -> bool {
        self.keys.lock().unwrap().contains_key(key)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Mutex};
    use std::thread;

    fn rendezvous(store: &MemoryStore, rank: usize, seconds: f64) -> Rendezvous<'_> {
        Rendezvous {
            store,
            prefix: "p",
            rank,
            timeout: Duration::from_secs_f64(seconds),
        }
    }

    #[test]
    fn every_rank_gets_the_same_addresses_and_token() {
        let store = Arc::new(MemoryStore::default());
        let results: Vec<TcpExchange> = (0..3)
            .map(|rank| {
                let store = Arc::clone(&store);
                thread::spawn(move || {
                    let address = format!("127.0.0.1:{}", 1000 + rank);
                    let intra = format!("127.0.0.1:{}", 2000 + rank);
                    let inter = format!("127.0.0.1:{}", 3000 + rank);
                    let members: (&[usize], &[usize]) = (&[0, 1, 2], &[rank]);
                    rendezvous(&store, rank, 5.0)
                        .tcp_peers(3, &address, Some((&intra, &inter)), Some(members))
                        .unwrap()
                })
            })
            .collect::<Vec<_>>()
            .into_iter()
            .map(|h| h.join().unwrap())
            .collect();
        for (rank, got) in results.iter().enumerate() {
            assert_eq!(
                got.addresses,
                ["127.0.0.1:1000", "127.0.0.1:1001", "127.0.0.1:1002"]
            );
            assert_eq!(got.token, results[0].token);
            assert_eq!(got.token.len(), crate::comm::tcp::TOKEN_LEN);
            let (intra, inter) = got.two_d.clone().unwrap();
            assert_eq!(
                intra,
                ["127.0.0.1:2000", "127.0.0.1:2001", "127.0.0.1:2002"]
            );
            assert_eq!(inter, [format!("127.0.0.1:{}", 3000 + rank)]);
            let peers = got.peers();
            assert_eq!(peers.addresses.len(), 3);
            assert_eq!(peers.intra_addresses.map(<[_]>::len), Some(3));
        }
    }

    #[test]
    fn a_missing_rank_is_named_after_the_timeout() {
        let store = MemoryStore::default();
        // Rank 1 of 3 arrives; ranks 0 (and so the token) and 2 never do.
        let err = rendezvous(&store, 1, 0.2)
            .tcp_peers(3, "127.0.0.1:1", None, None)
            .unwrap_err();
        match err {
            Error::CommTimeout { peer, message } => {
                assert_eq!(peer, 0);
                assert_eq!(
                    message,
                    "rank 1: ranks 0, 2 did not reach the start-up exchange 'p/addr' within \
                     0.2 s (stopped, killed or still starting; see their own output)"
                );
            }
            other => panic!("expected CommTimeout, got {other:?}"),
        }
    }

    #[test]
    fn nccl_ids_are_made_once_by_each_groups_first_member() {
        let store = Arc::new(MemoryStore::default());
        let made = Arc::new(Mutex::new(Vec::new()));
        // Two nodes of two ranks: nodes {0,1} and {2,3}; inter groups {0,2}, {1,3}.
        let handles: Vec<_> = (0..4)
            .map(|rank| {
                let (store, made) = (Arc::clone(&store), Arc::clone(&made));
                thread::spawn(move || {
                    let node: Vec<usize> = if rank < 2 { vec![0, 1] } else { vec![2, 3] };
                    let across = vec![rank % 2, rank % 2 + 2];
                    let mut counter = 0u8;
                    let mut new_id = || {
                        counter += 1;
                        made.lock().unwrap().push(rank);
                        Ok(vec![rank as u8, counter])
                    };
                    rendezvous(&store, rank, 5.0)
                        .nccl_ids(2, Some((&node, &across)), &mut new_id)
                        .unwrap()
                })
            })
            .collect();
        let ids: Vec<NcclIdLists> = handles.into_iter().map(|h| h.join().unwrap()).collect();
        for (rank, (world, two_d)) in ids.iter().enumerate() {
            assert_eq!(world, &[vec![0, 1], vec![0, 2]]);
            let (intra, inter) = two_d.clone().unwrap();
            assert_eq!(intra[0][0], if rank < 2 { 0 } else { 2 });
            assert_eq!(inter[0][0], (rank % 2) as u8);
            assert_eq!(intra.len(), 2);
        }
        // world: rank 0 twice; intra: ranks 0 and 2 twice each; inter: ranks 0, 1 twice each.
        let mut makers = made.lock().unwrap().clone();
        makers.sort_unstable();
        assert_eq!(makers, [0, 0, 0, 0, 0, 0, 1, 1, 2, 2]);
    }

    #[test]
    fn timeouts_print_as_people_set_them() {
        assert_eq!(seconds_text(Duration::from_secs(1800)), "1800");
        assert_eq!(seconds_text(Duration::from_secs_f64(0.5)), "0.5");
        assert_eq!(seconds_text(Duration::from_secs_f64(2.25)), "2.25");
    }
}
