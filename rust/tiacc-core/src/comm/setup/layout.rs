//! The 2D layout an engine is built with, agreed through the rendezvous
//! before anything listens: whether the 2D groups connect at all (the
//! configuration's rule, and for a group every member's vote), the ranks
//! per node, and that check against where every rank runs (host names and
//! local ranks exchanged through the store).

use super::super::algo::Layout;
use super::super::store::Rendezvous;
use crate::config::CommConfig;
use crate::error::{Error, Result};

/// Where this rank runs, as the launcher said.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Placement {
    /// Ranks per node.
    pub local_size: Option<usize>,
    /// This rank's rank on its node.
    pub local_rank: Option<usize>,
}

/// Whose engine the layout is agreed for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scope {
    /// The default group's engines: ranks that do not form whole nodes in
    /// order are a configuration error.
    World,
    /// A group of the "tiacc" backend: the 2D groups only when every member
    /// asks for them (a rank alone asking would wait for peers that never
    /// join), and a group whose ranks do not form whole nodes (a subgroup
    /// across hosts) runs flat: every member reaches the same verdict from
    /// the same hosts, and [`TwoD::note`] says why.
    Group,
}

/// What the rendezvous agreed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TwoD {
    /// The 2D layout, when the 2D groups connect.
    pub layout: Option<Layout>,
    /// The line rank 0 logs when a group runs flat for want of whole nodes.
    pub note: Option<String>,
}

impl Rendezvous<'_> {
    /// The 2D layout of an engine of `size` ranks: `None` unless the
    /// configuration connects the 2D groups
    /// ([`CommConfig::two_d_groups`]); else nodes of
    /// [`CommConfig::intra_size_for`] ranks, checked first against the
    /// world (before any exchange, so no peer waits on a rank that knows it
    /// fails) and then against every rank's host name and local rank,
    /// exchanged under `<prefix>/host`. Under [`Scope::Group`] every member
    /// first votes under `<prefix>/two-d`.
    ///
    /// # Errors
    /// [`Error::Config`] naming `LIGHT_INTRA_SIZE` when the ranks do not
    /// form whole nodes in order ([`Scope::World`] only); a timeout naming
    /// the ranks that never published.
    pub fn two_d_layout(
        &self,
        config: &CommConfig,
        size: usize,
        placement: Placement,
        scope: Scope,
    ) -> Result<TwoD> {
        let wanted = config.two_d_groups(size, placement.local_size);
        if scope == Scope::Group {
            let mine = if wanted { "1" } else { "0" };
            let votes = self.each(&format!("{}/two-d", self.prefix), size, mine)?;
            if votes.iter().any(|v| v != "1") {
                return Ok(TwoD::default());
            }
        }
        if !wanted {
            return Ok(TwoD::default());
        }
        match self.node_layout(config, size, placement) {
            Ok(layout) => Ok(TwoD {
                layout: Some(layout),
                note: None,
            }),
            Err(err @ Error::Config { .. }) if scope == Scope::Group => Ok(TwoD {
                layout: None,
                note: Some(format!(
                    "  a group of {size} ranks runs its collectives flat: {err}"
                )),
            }),
            Err(err) => Err(err),
        }
    }

    /// Nodes of the configuration's ranks per node, checked against the
    /// world and then against every rank's host.
    fn node_layout(
        &self,
        config: &CommConfig,
        size: usize,
        placement: Placement,
    ) -> Result<Layout> {
        let intra_size = config.intra_size_for(placement.local_size)?;
        Layout::new(self.rank, size, intra_size)?;
        let mine = host_entry(&host_name(), placement.local_rank);
        let hosts = self
            .each(&format!("{}/host", self.prefix), size, &mine)?
            .iter()
            .enumerate()
            .map(|(r, text)| {
                parse_host_entry(text).ok_or_else(|| Error::Comm {
                    peer: Some(r),
                    message: format!(
                        "rank {}: rank {r}'s host entry {text:?} is not [host, local rank]",
                        self.rank
                    ),
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Layout::from_hosts(self.rank, intra_size, &hosts)
    }

    /// Every rank's `value` under `what`, in rank order (this rank publishes
    /// `value` as `<what>/<rank>`).
    fn each(&self, what: &str, size: usize, value: &str) -> Result<Vec<String>> {
        self.store
            .set(&format!("{what}/{}", self.rank), value.as_bytes())?;
        let keys: Vec<String> = (0..size).map(|r| format!("{what}/{r}")).collect();
        self.wait_for(&keys, &(0..size).collect::<Vec<_>>(), what)?;
        keys.iter()
            .map(|key| {
                let bytes = self.store.get(key)?;
                String::from_utf8(bytes).map_err(|_| Error::Comm {
                    peer: None,
                    message: format!(
                        "rank {}: the start-up exchange's key {key} is not text",
                        self.rank
                    ),
                })
            })
            .collect()
    }
}

/// This machine's host name (as Python's `socket.gethostname`).
pub fn host_name() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: `buf` is writable for its whole length.
    let rc = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
    if rc != 0 {
        return String::new();
    }
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    String::from_utf8_lossy(&buf[..end]).into_owned()
}

/// `[host, local rank]` as JSON (`json.dumps` writes it the same way).
fn host_entry(host: &str, local_rank: Option<usize>) -> String {
    let mut quoted = String::with_capacity(host.len() + 2);
    for c in host.chars() {
        match c {
            '"' => quoted.push_str("\\\""),
            '\\' => quoted.push_str("\\\\"),
            c if (c as u32) < 0x20 || !c.is_ascii() => {
                let mut units = [0u16; 2];
                for unit in c.encode_utf16(&mut units) {
                    quoted.push_str(&format!("\\u{unit:04x}"));
                }
            }
            c => quoted.push(c),
        }
    }
    let local = local_rank.map_or("null".to_string(), |l| l.to_string());
    format!("[\"{quoted}\", {local}]")
}

/// [`host_entry`]'s text read back.
fn parse_host_entry(text: &str) -> Option<(String, Option<usize>)> {
    let inner = text.strip_prefix("[\"")?.strip_suffix(']')?;
    let (quoted, local) = inner.rsplit_once("\", ")?;
    let local = match local {
        "null" => None,
        n => Some(n.parse().ok()?),
    };
    let mut host = String::new();
    let mut units = Vec::new();
    let mut chars = quoted.chars();
    while let Some(c) = chars.next() {
        if c != '\\' {
            host.push_str(&String::from_utf16(&std::mem::take(&mut units)).ok()?);
            host.push(c);
            continue;
        }
        match chars.next()? {
            'u' => {
                let hex: String = chars.by_ref().take(4).collect();
                units.push(u16::from_str_radix(&hex, 16).ok()?);
            }
            e => {
                host.push_str(&String::from_utf16(&std::mem::take(&mut units)).ok()?);
                host.push(e);
            }
        }
    }
    host.push_str(&String::from_utf16(&units).ok()?);
    Some((host, local))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::store::MemoryStore;
    use crate::config::AlgorithmChoice;
    use std::sync::Arc;
    use std::time::Duration;

    /// What each of 4 ranks (2 per node, all on this host) agrees, rank `r`
    /// with `configs[r]`, local rank `local_rank(r)`, under `scope`; also
    /// the keys the store holds afterwards.
    fn agree(
        configs: [CommConfig; 4],
        local_rank: fn(usize) -> Option<usize>,
        scope: Scope,
    ) -> (Vec<Result<TwoD>>, Vec<String>) {
        let store = Arc::new(MemoryStore::default());
        let results = configs
            .into_iter()
            .enumerate()
            .map(|(rank, config)| {
                let store = Arc::clone(&store);
                std::thread::spawn(move || {
                    let rendezvous = Rendezvous {
                        store: &*store,
                        prefix: "p",
                        rank,
                        timeout: Duration::from_secs(5),
                    };
                    let placement = Placement {
                        local_size: Some(2),
                        local_rank: local_rank(rank),
                    };
                    rendezvous.two_d_layout(&config, 4, placement, scope)
                })
            })
            .collect::<Vec<_>>()
            .into_iter()
            .map(|h| h.join().unwrap())
            .collect();
        (results, store.keys())
    }

    fn algorithm(algorithm: AlgorithmChoice) -> CommConfig {
        CommConfig {
            algorithm,
            ..CommConfig::default()
        }
    }

    #[test]
    fn whole_nodes_agree_on_the_layout_after_exchanging_hosts() {
        for scope in [Scope::World, Scope::Group] {
            let configs = [(); 4].map(|_| algorithm(AlgorithmChoice::Auto));
            let (results, keys) = agree(configs, |r| Some(r % 2), scope);
            for (rank, result) in results.into_iter().enumerate() {
                let two_d = result.unwrap();
                assert_eq!(two_d.layout, Some(Layout::new(rank, 4, 2).unwrap()));
                assert_eq!(two_d.note, None);
            }
            let hosts = keys.iter().filter(|k| k.starts_with("p/host/")).count();
            let votes = keys.iter().filter(|k| k.starts_with("p/two-d/")).count();
            assert_eq!(
                (hosts, votes),
                (4, if scope == Scope::Group { 4 } else { 0 })
            );
        }
    }

    #[test]
    fn flat_needs_no_exchange_and_one_group_member_s_no_keeps_the_group_flat() {
        let configs = [(); 4].map(|_| algorithm(AlgorithmChoice::Flat));
        let (results, keys) = agree(configs, |r| Some(r % 2), Scope::World);
        assert!(results.into_iter().all(|r| r.unwrap() == TwoD::default()));
        assert!(keys.is_empty());
        let mut configs = [(); 4].map(|_| algorithm(AlgorithmChoice::TwoD));
        configs[3] = algorithm(AlgorithmChoice::Flat);
        let (results, keys) = agree(configs, |r| Some(r % 2), Scope::Group);
        assert!(results.into_iter().all(|r| r.unwrap() == TwoD::default()));
        assert!(keys.iter().all(|k| k.starts_with("p/two-d/")));
    }

    #[test]
    fn ranks_out_of_node_order_fail_the_world_and_leave_a_group_flat() {
        // Local ranks 1, 0, 0, 1: rank 0 is not its node's first.
        let configs = || [(); 4].map(|_| algorithm(AlgorithmChoice::TwoD));
        let swapped = |r: usize| Some(usize::from(r == 0 || r == 3));
        let (results, _) = agree(configs(), swapped, Scope::World);
        let expected = "LIGHT_INTRA_SIZE=\"2\" is invalid: expected the number of ranks per \
                        host: rank 0 has local rank 1, expected 0 with 2 ranks per node";
        for result in results {
            match result.unwrap_err() {
                err @ Error::Config { .. } => assert_eq!(err.to_string(), expected),
                other => panic!("expected a configuration error, got {other:?}"),
            }
        }
        let (results, _) = agree(configs(), swapped, Scope::Group);
        for result in results {
            let two_d = result.unwrap();
            assert_eq!(two_d.layout, None);
            let note = format!("  a group of 4 ranks runs its collectives flat: {expected}");
            assert_eq!(two_d.note.as_deref(), Some(note.as_str()));
        }
    }

    #[test]
    fn host_entries_read_back_and_match_json_dumps() {
        assert_eq!(host_entry("node-1", Some(3)), r#"["node-1", 3]"#);
        assert_eq!(
            host_entry("a\"b\\c\u{e9}", None),
            r#"["a\"b\\c\u00e9", null]"#
        );
        for (host, local) in [("node-1", Some(3)), ("a\"b\\c\u{e9}\u{1f600}", None)] {
            let text = host_entry(host, local);
            assert_eq!(parse_host_entry(&text), Some((host.to_string(), local)));
        }
        assert_eq!(parse_host_entry("node-1"), None);
        assert!(!host_name().is_empty());
    }
}
