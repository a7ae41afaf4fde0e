//! The scan of the environment for names under the prefixes we own that we
//! do not know, with the closest known name as a suggestion, and the
//! notices for aliases that have no meaning here ([`IGNORED`]).

use std::collections::BTreeMap;
use std::ffi::OsString;

use super::startup::Warning;
use super::{DIAGNOSTIC_VARIABLES, IGNORED, INTERFACE_VARIABLES, STRICT, VARIABLES};
use crate::error::{Error, Result};

/// The prefixes whose every variable we claim: one we do not know is a
/// warning (an error under [`STRICT`]).
pub const SCAN_PREFIXES: [&str; 3] = ["TIACC_TRAINING_", "LIGHT_", "PERSEUS_"];

/// Prefixes set aside when comparing the rest of two names, so that
/// `TIACC_TRAINING_TOPK_RATIO` finds `LIGHT_TOPK_RATIO`.
const FAMILY_PREFIXES: [&str; 6] = [
    "TIACC_TRAINING_",
    "LIGHT_",
    "PERSEUS_",
    "HOROVOD_",
    "GLOO_",
    "NCCL_",
];

/// Every name the engine knows: the variables it reads, the interface
/// variables, the strict switch and the aliases it recognises as ignored.
pub fn known_names() -> impl Iterator<Item = &'static str> {
    VARIABLES
        .iter()
        .copied()
        .chain(INTERFACE_VARIABLES)
        .chain(DIAGNOSTIC_VARIABLES)
        .chain(std::iter::once(STRICT))
        .chain(IGNORED.iter().map(|(name, _)| *name))
}

/// The optimal-string-alignment distance between `a` and `b`: insertions,
/// deletions, substitutions and swaps of two adjacent characters cost one.
pub fn edit_distance(a: &str, b: &str) -> usize {
    let a: Vec<char> = a.chars().collect();
    let b: Vec<char> = b.chars().collect();
    // rows[i][j]: distance between a[..i] and b[..j]; three rows kept.
    let mut before = vec![0usize; b.len() + 1];
    let mut previous: Vec<usize> = (0..=b.len()).collect();
    let mut current = vec![0usize; b.len() + 1];
    for i in 1..=a.len() {
        current[0] = i;
        for j in 1..=b.len() {
            let cost = usize::from(a[i - 1] != b[j - 1]);
            let mut d = (previous[j] + 1)
                .min(current[j - 1] + 1)
                .min(previous[j - 1] + cost);
            if i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1] {
                d = d.min(before[j - 2] + 1);
            }
            current[j] = d;
        }
        std::mem::swap(&mut before, &mut previous);
        std::mem::swap(&mut previous, &mut current);
    }
    previous[b.len()]
}

fn family_rest(name: &str) -> &str {
    FAMILY_PREFIXES
        .iter()
        .find_map(|p| name.strip_prefix(p))
        .unwrap_or(name)
}

/// The known name closest to `name`, when one is close enough to be a
/// likely meaning: the distance of the whole names, or of the parts after
/// the prefix plus one (another family's spelling of the same thing),
/// at most half the length of `name`'s part after its prefix (and at
/// least 2). Ties go to the first name in [`known_names`].
pub fn closest_known(name: &str) -> Option<&'static str> {
    let upper = name.to_ascii_uppercase();
    let rest = family_rest(&upper);
    let limit = (rest.chars().count() / 2).max(2);
    let mut best: Option<(usize, &'static str)> = None;
    for known in known_names() {
        let score = edit_distance(&upper, known)
            .min(edit_distance(rest, family_rest(known)) + usize::from(known != upper));
        if score <= limit && best.is_none_or(|(b, _)| score < b) {
            best = Some((score, known));
        }
    }
    best.map(|(_, known)| known)
}

fn claimed(name: &str) -> bool {
    SCAN_PREFIXES.iter().any(|p| name.starts_with(p))
}

fn is_known(name: &str) -> bool {
    known_names().any(|k| k == name)
}

/// The notices for `vars` (an environment): one per unknown name under
/// [`SCAN_PREFIXES`] (naming the closest known name), then one per
/// ignored alias that is set. Under `strict`, an unknown name is an
/// `Error::Config` naming the first of them and its suggestion.
pub(super) fn scan(vars: &BTreeMap<String, OsString>, strict: bool) -> Result<Vec<Warning>> {
    let unknown: Vec<(&str, Option<&'static str>)> = vars
        .keys()
        .filter(|name| claimed(name) && !is_known(name))
        .map(|name| (name.as_str(), closest_known(name)))
        .collect();
    let hint = |suggestion: Option<&str>| match suggestion {
        Some(known) => format!("did you mean {known}?"),
        None => {
            "no known name is close; the variables are listed in docs/communication.md".to_string()
        }
    };
    if strict {
        if let Some(&(name, suggestion)) = unknown.first() {
            let others: Vec<&str> = unknown[1..].iter().map(|(n, _)| *n).collect();
            let also = if others.is_empty() {
                String::new()
            } else {
                format!("; also unknown: {}", others.join(", "))
            };
            return Err(Error::Config {
                variable: name.to_string(),
                value: vars[name].to_string_lossy().into_owned(),
                expected: format!(
                    "a variable name tiacc_training knows: {} ({STRICT}=1 makes an unknown \
                     TIACC_TRAINING_, LIGHT_ or PERSEUS_ name an error{also})",
                    hint(suggestion)
                ),
            });
        }
    }
    let mut notices: Vec<Warning> = unknown
        .iter()
        .map(|&(name, suggestion)| Warning {
            variable: name.to_string(),
            message: format!(
                "is not a variable tiacc_training knows and has no effect: {}",
                hint(suggestion)
            ),
        })
        .collect();
    for (name, reason) in IGNORED {
        let set = vars
            .get(*name)
            .is_some_and(|v| !v.to_string_lossy().trim().is_empty());
        if set {
            notices.push(Warning {
                variable: name.to_string(),
                message: format!("is ignored: {reason}"),
            });
        }
    }
    Ok(notices)
}

#[cfg(test)]
mod tests {
    use super::super::{
        CommConfig, Interface, Setting, ACCUMULATE_N_STEPS, ALGORITHM, COMPRESSION,
        FUSION_THRESHOLD, GLOO_SOCKET_IFNAME, HOROVOD_FUSION_THRESHOLD, HOROVOD_HIERARCHICAL,
        NCCL_SOCKET_IFNAME, NUM_STREAMS, PERSEUS_ACCUMULATE_N_STEPS, PERSEUS_DTYPE, PERSEUS_FUSION,
        PERSEUS_GLOO_INTERFACE, PERSEUS_NCCL_INTERFACE, PERSEUS_STREAMS, SOCKET_ADDR, TOPK_RATIO,
    };
    use super::*;
    use crate::config::AlgorithmChoice;
    use std::net::{IpAddr, Ipv4Addr};

    fn vars(pairs: &[(&str, &str)]) -> Vec<(OsString, OsString)> {
        pairs
            .iter()
            .map(|(k, v)| (OsString::from(k), OsString::from(v)))
            .collect()
    }

    fn fake_interfaces() -> Result<Vec<Interface>> {
        Ok(vec![
            Interface::new("lo", Some(Ipv4Addr::LOCALHOST)),
            Interface::new("eth0", Some(Ipv4Addr::new(10, 0, 0, 2))),
            Interface::new("eth1", Some(Ipv4Addr::new(10, 1, 0, 2))),
            Interface::new("ib0", None),
        ])
    }

    fn config(pairs: &[(&str, &str)]) -> Result<CommConfig> {
        CommConfig::from_vars(vars(pairs), &fake_interfaces)
    }

    fn notices(c: &CommConfig) -> Vec<String> {
        c.notices
            .iter()
            .map(|w| format!("{} {}", w.variable, w.message))
            .collect()
    }

    #[test]
    fn the_distance_counts_edits_and_swaps() {
        assert_eq!(edit_distance("", ""), 0);
        assert_eq!(edit_distance("abc", ""), 3);
        assert_eq!(edit_distance("RATO", "RATIO"), 1);
        assert_eq!(edit_distance("RAITO", "RATIO"), 1);
        assert_eq!(edit_distance("kitten", "sitting"), 3);
        assert_eq!(edit_distance("STREAMS", "STREAMS"), 0);
    }

    #[test]
    fn the_closest_known_name_is_suggested_when_close() {
        assert_eq!(closest_known("LIGHT_TOPK_RATO"), Some(TOPK_RATIO));
        assert_eq!(closest_known("light_topk_ratio"), Some(TOPK_RATIO));
        // Another family's prefix on one of our names.
        assert_eq!(closest_known("TIACC_TRAINING_TOPK_RATIO"), Some(TOPK_RATIO));
        assert_eq!(
            closest_known("PERSEUS_ALLREDUCE_STREAM"),
            Some(PERSEUS_STREAMS)
        );
        assert_eq!(
            closest_known("TIACC_TRAINING_NUM_STREAMS"),
            Some(NUM_STREAMS)
        );
        assert_eq!(closest_known("TIACC_TRAINING_XYZZY_PLUGH"), None);
        assert_eq!(closest_known("LIGHT_ZZ"), None);
    }

    #[test]
    fn unknown_names_are_one_notice_each_and_others_are_left_alone() {
        let c = config(&[
            ("LIGHT_TOPK_RATO", "0.01"),
            ("PERSEUS_ALLREDUCE_STREAM", "3"),
            ("TIACC_TRAINING_XYZZY_PLUGH", "1"),
            ("HOROVOD_CYCLE_TIME", "5"),
            ("HOROVOD_RANK", "0"),
            ("LIGHTNING_NODE_RANK", "0"),
            ("PATH", "/usr/bin"),
            (TOPK_RATIO, "0.1"),
        ])
        .unwrap();
        let got = notices(&c);
        assert_eq!(got.len(), 4, "{got:?}");
        assert_eq!(
            got[0],
            "LIGHT_TOPK_RATO is not a variable tiacc_training knows and has no effect: did you \
             mean LIGHT_TOPK_RATIO?"
        );
        assert!(
            got[1].starts_with("PERSEUS_ALLREDUCE_STREAM is not"),
            "{got:?}"
        );
        assert!(got[1].ends_with("did you mean PERSEUS_ALLREDUCE_STREAMS?"));
        assert!(got[2].contains("no known name is close"), "{got:?}");
        assert!(
            got[3].starts_with("HOROVOD_CYCLE_TIME is ignored: "),
            "{got:?}"
        );
        // The known ones are read as usual.
        assert_eq!(c.topk_ratio, 0.1);
    }

    #[test]
    fn the_start_up_report_warns_with_the_notices_first() {
        use super::super::startup::Job;
        let c = config(&[("LIGHT_TOPK_RATO", "0.1"), (TOPK_RATIO, "0.1")]).unwrap();
        let job = Job {
            world: 2,
            launcher: "torchrun".into(),
            local_size: Some(2),
            cuda: None,
        };
        let named: Vec<String> = c
            .startup(&job)
            .warnings
            .into_iter()
            .map(|w| w.variable)
            .collect();
        assert_eq!(named, vec!["LIGHT_TOPK_RATO", TOPK_RATIO]);
        let c = config(&[(PERSEUS_FUSION, "8"), (PERSEUS_ACCUMULATE_N_STEPS, "4")]).unwrap();
        let line = &c.startup(&job).lines[0];
        assert!(
            line.contains(
                "fusion_threshold=1/8 of each model's gradient bytes (from \
                 PERSEUS_ALLREDUCE_FUSION; for DDP models built without bucket_cap_mb)"
            ),
            "{line}"
        );
        assert!(line.contains("accumulate_n_steps=4 (one communication every 4 backward passes)"));
    }

    #[test]
    fn strict_mode_makes_an_unknown_name_an_error_naming_it_and_the_suggestion() {
        let err = config(&[
            ("TIACC_TRAINING_STRICT", "1"),
            ("LIGHT_TOPK_RATO", "0.01"),
            ("PERSEUS_FOO", "1"),
        ])
        .unwrap_err();
        let Error::Config {
            variable, value, ..
        } = &err
        else {
            panic!("{err:?}")
        };
        assert_eq!(
            (variable.as_str(), value.as_str()),
            ("LIGHT_TOPK_RATO", "0.01")
        );
        let text = err.to_string();
        assert!(text.contains("did you mean LIGHT_TOPK_RATIO?"), "{text}");
        assert!(text.contains("also unknown: PERSEUS_FOO"), "{text}");
        // Known names and ignored aliases are fine under strict mode.
        let c = config(&[
            (STRICT, "1"),
            (TOPK_RATIO, "0.5"),
            ("HOROVOD_CYCLE_TIME", "1"),
        ]);
        assert_eq!(c.unwrap().notices.len(), 1);
        assert!(config(&[(STRICT, "0"), ("LIGHT_X", "1")]).is_ok());
        let err = config(&[(STRICT, "sure")]).unwrap_err().to_string();
        assert!(err.contains(STRICT), "{err}");
    }

    #[test]
    fn aliases_map_onto_our_settings() {
        let c = config(&[(PERSEUS_STREAMS, "6")]).unwrap();
        assert_eq!(c.num_streams, 6);
        assert_eq!(c.source(Setting::NumStreams), Some(PERSEUS_STREAMS));
        let err = config(&[(PERSEUS_STREAMS, "0")]).unwrap_err().to_string();
        assert!(err.contains(PERSEUS_STREAMS), "{err}");

        let c = config(&[(HOROVOD_FUSION_THRESHOLD, "1048576")]).unwrap();
        assert_eq!(
            (c.fusion_threshold, c.bucket_bytes(1 << 30)),
            (1 << 20, 1 << 20)
        );
        // Horovod's 0 is no fusion: a gradient per bucket.
        assert_eq!(
            config(&[(HOROVOD_FUSION_THRESHOLD, "0")])
                .unwrap()
                .fusion_threshold,
            1
        );

        let c = config(&[(PERSEUS_FUSION, "16")]).unwrap();
        assert_eq!(c.fusion_fraction, Some(16));
        assert_eq!(c.bucket_bytes(1600), 100);
        assert_eq!(c.bucket_bytes(1601), 101);
        assert_eq!(c.bucket_bytes(0), 1);
        let auto = config(&[(PERSEUS_FUSION, "0")]).unwrap();
        assert_eq!(
            auto.bucket_bytes(1 << 40),
            CommConfig::default().fusion_threshold
        );
        for bad in ["129", "-1", "half"] {
            let err = config(&[(PERSEUS_FUSION, bad)]).unwrap_err().to_string();
            assert!(err.contains(PERSEUS_FUSION), "{err}");
        }
        // Our name replaces the fraction.
        let c = config(&[(PERSEUS_FUSION, "16"), (FUSION_THRESHOLD, "4096")]).unwrap();
        assert_eq!((c.fusion_fraction, c.bucket_bytes(1 << 30)), (None, 4096));

        let c = config(&[(PERSEUS_ACCUMULATE_N_STEPS, "4")]).unwrap();
        assert_eq!(c.accumulate_n_steps, 4);
        assert_eq!(CommConfig::default().accumulate_n_steps, 1);
        for bad in ["0", "two"] {
            let err = config(&[(ACCUMULATE_N_STEPS, bad)])
                .unwrap_err()
                .to_string();
            assert!(err.contains(ACCUMULATE_N_STEPS), "{err}");
        }

        let c = config(&[(HOROVOD_HIERARCHICAL, "1")]).unwrap();
        assert_eq!(c.algorithm, AlgorithmChoice::TwoD);
        let c = config(&[(HOROVOD_HIERARCHICAL, "1"), (ALGORITHM, "auto")]).unwrap();
        assert_eq!(c.algorithm, AlgorithmChoice::Auto);
    }

    #[test]
    fn our_name_wins_over_an_alias_and_a_disagreement_names_both_once() {
        let c = config(&[(PERSEUS_STREAMS, "3"), (NUM_STREAMS, "4")]).unwrap();
        assert_eq!(c.num_streams, 4);
        assert_eq!(
            notices(&c),
            vec![
                "PERSEUS_ALLREDUCE_STREAMS is set to \"3\" and TIACC_TRAINING_NUM_NCCL_STREAMS \
                 to \"4\", which disagree: TIACC_TRAINING_NUM_NCCL_STREAMS wins"
            ]
        );
        // Agreeing values say nothing.
        let c = config(&[(PERSEUS_STREAMS, "4"), (NUM_STREAMS, " 4")]).unwrap();
        assert!(c.notices.is_empty(), "{:?}", c.notices);
        let c = config(&[(PERSEUS_ACCUMULATE_N_STEPS, "2"), (ACCUMULATE_N_STEPS, "8")]).unwrap();
        assert_eq!(c.accumulate_n_steps, 8);
        assert_eq!(c.notices.len(), 1);
        assert_eq!(c.notices[0].variable, PERSEUS_ACCUMULATE_N_STEPS);
        let c = config(&[
            (PERSEUS_FUSION, "8"),
            (HOROVOD_FUSION_THRESHOLD, "1000"),
            (FUSION_THRESHOLD, "2000"),
        ])
        .unwrap();
        assert_eq!(c.bucket_bytes(1 << 20), 2000);
        let named: Vec<&str> = c.notices.iter().map(|w| w.variable.as_str()).collect();
        assert_eq!(named, vec![PERSEUS_FUSION, HOROVOD_FUSION_THRESHOLD]);
        // An alias setting two of our settings, overridden in one.
        let c = config(&[(PERSEUS_DTYPE, "0"), (COMPRESSION, "none")]).unwrap();
        assert_eq!(c.notices.len(), 1);
        assert!(c.notices[0].message.contains(COMPRESSION));
    }

    #[test]
    fn interface_variables_choose_the_transport_address() {
        let addr = |pairs: &[(&str, &str)]| config(pairs).unwrap().socket_addr;
        let ip = |a, b, c, d| Some(IpAddr::V4(Ipv4Addr::new(a, b, c, d)));
        assert_eq!(addr(&[]), None);
        assert_eq!(addr(&[(PERSEUS_GLOO_INTERFACE, "eth1")]), ip(10, 1, 0, 2));
        assert_eq!(addr(&[(GLOO_SOCKET_IFNAME, "eth0,eth1")]), ip(10, 0, 0, 2));
        assert_eq!(addr(&[(PERSEUS_NCCL_INTERFACE, "lo")]), ip(127, 0, 0, 1));
        // NCCL's list format: prefixes, `=` exact names, `^` exclusions.
        assert_eq!(addr(&[(NCCL_SOCKET_IFNAME, "eth")]), ip(10, 0, 0, 2));
        assert_eq!(addr(&[(NCCL_SOCKET_IFNAME, "ib,eth1")]), ip(10, 1, 0, 2));
        assert_eq!(addr(&[(NCCL_SOCKET_IFNAME, "=eth1")]), ip(10, 1, 0, 2));
        assert_eq!(addr(&[(NCCL_SOCKET_IFNAME, "^lo,eth0")]), ip(10, 1, 0, 2));
        assert_eq!(addr(&[(NCCL_SOCKET_IFNAME, "^=lo,eth0")]), ip(10, 1, 0, 2));
        // As in NCCL, an exclusion list may pick the loopback interface.
        assert_eq!(addr(&[(NCCL_SOCKET_IFNAME, "^eth0")]), ip(127, 0, 0, 1));

        // Precedence: the explicit address, then gloo's, then NCCL's.
        let c = config(&[
            (NCCL_SOCKET_IFNAME, "eth0"),
            (GLOO_SOCKET_IFNAME, "eth1"),
            (PERSEUS_GLOO_INTERFACE, "lo"),
        ])
        .unwrap();
        assert_eq!(c.socket_addr, ip(127, 0, 0, 1));
        assert_eq!(c.source(Setting::SocketAddr), Some(PERSEUS_GLOO_INTERFACE));
        // One notice for the gloo name that lost, none for NCCL's own.
        assert_eq!(notices(&c).len(), 1, "{:?}", notices(&c));
        assert!(notices(&c)[0].starts_with("GLOO_SOCKET_IFNAME is set to \"eth1\""));
        let c = config(&[(SOCKET_ADDR, "10.9.9.9"), (PERSEUS_GLOO_INTERFACE, "nope")]).unwrap();
        assert_eq!(c.socket_addr, ip(10, 9, 9, 9));
        assert!(notices(&c)[0].contains("uses TIACC_TRAINING_SOCKET_ADDR"));

        // AIACC's NCCL interface reaches NCCL where NCCL's own is unset.
        let c = config(&[(PERSEUS_NCCL_INTERFACE, "eth1")]).unwrap();
        assert_eq!(c.nccl_socket_ifname.as_deref(), Some("=eth1"));
        let c = config(&[
            (PERSEUS_NCCL_INTERFACE, "eth1"),
            (NCCL_SOCKET_IFNAME, "eth0"),
        ]);
        assert_eq!(c.unwrap().nccl_socket_ifname, None);

        for (variable, value) in [
            (PERSEUS_GLOO_INTERFACE, "eth7"),
            (GLOO_SOCKET_IFNAME, "ib0"),
            (NCCL_SOCKET_IFNAME, "^lo,eth,ib"),
            (NCCL_SOCKET_IFNAME, "=eth"),
        ] {
            let err = config(&[(variable, value)]).unwrap_err();
            let text = err.to_string();
            assert!(text.starts_with(&format!("{variable}=")), "{text}");
            assert!(
                text.contains("lo (127.0.0.1), eth0 (10.0.0.2), eth1 (10.1.0.2), ib0 (no IPv4)"),
                "{text}"
            );
        }
    }

    #[test]
    fn the_loopback_interface_of_this_host_resolves() {
        let c = CommConfig::from_vars(vars(&[(PERSEUS_GLOO_INTERFACE, "lo")]), &|| {
            super::super::system_interfaces()
        })
        .unwrap();
        assert_eq!(c.socket_addr, Some(IpAddr::V4(Ipv4Addr::LOCALHOST)));
        let err = CommConfig::from_vars(
            vars(&[(PERSEUS_GLOO_INTERFACE, "no-such-nic0")]),
            &super::super::system_interfaces,
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("lo (127.0.0.1)"), "{err}");
    }
}
