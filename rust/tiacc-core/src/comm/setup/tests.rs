//! Tests of the engines' set-up.

use super::*;
use crate::comm::tcp::random_token;
use crate::comm::{Collective, DType};

fn config(algorithm: AlgorithmChoice) -> CommConfig {
    CommConfig {
        algorithm,
        num_streams: 2,
        shared_memory: false,
        timeout: Duration::from_secs(20),
        // The smallest probe.
        fusion_threshold: 1,
        ..CommConfig::default()
    }
}

/// What each rank of a job of 2 nodes x 2 ranks (`intra_size` 2, or
/// flat without it) reports once connected: `auto`'s line, whether it
/// goes 2D, and the sum of a small allreduce.
fn two_by_two(
    config: CommConfig,
    intra_size: Option<usize>,
) -> Vec<(Option<String>, bool, Vec<f32>)> {
    let engines: Vec<CommEngine> = (0..4)
        .map(|rank| {
            let layout = intra_size.map(|n| Layout::new(rank, 4, n).unwrap());
            let setup = EngineSetup::with_layout(&config, rank, 4, Some(2), layout).unwrap();
            CommEngine::new(setup, "127.0.0.1", None).unwrap()
        })
        .collect();
    let addresses: Vec<String> = engines.iter().map(|e| e.tcp().address().unwrap()).collect();
    let two_d: Vec<Option<(String, String)>> =
        engines.iter().map(|e| e.tcp().two_d_addresses()).collect();
    let token = random_token().unwrap();
    let handles: Vec<_> = engines
        .into_iter()
        .enumerate()
        .map(|(rank, mut engine)| {
            let addresses = addresses.clone();
            let two_d = two_d.clone();
            std::thread::spawn(move || {
                let members = engine.setup().two_d_members();
                let pick = |ranks: &[usize], inter: bool| -> Vec<String> {
                    ranks
                        .iter()
                        .map(|&r| {
                            let (a, e) = two_d[r].clone().unwrap();
                            if inter {
                                e
                            } else {
                                a
                            }
                        })
                        .collect()
                };
                let intra = members.as_ref().map(|(a, _)| pick(a, false));
                let inter = members.as_ref().map(|(_, e)| pick(e, true));
                let peers = TcpPeers {
                    addresses: &addresses,
                    token: &token,
                    intra_addresses: intra.as_deref(),
                    inter_addresses: inter.as_deref(),
                };
                engine.connect(&peers).unwrap();
                assert!(engine.connected());
                assert!(engine.tcp().address().is_none());
                let values: Vec<f32> = (0..1000).map(|i| (i % 7 + rank) as f32).collect();
                let mut bytes: Vec<u8> = values.iter().flat_map(|v| v.to_ne_bytes()).collect();
                let op = Collective::Allreduce { average: false };
                engine
                    .engine()
                    .unwrap()
                    .run(op, &mut bytes, DType::F32, 3)
                    .unwrap();
                let sums = bytes
                    .chunks_exact(4)
                    .map(|b| f32::from_ne_bytes([b[0], b[1], b[2], b[3]]))
                    .collect();
                let choice = engine.setup().auto_choice().map(str::to_string);
                let two_d = engine.setup().two_d();
                engine.shutdown();
                assert!(!engine.connected());
                assert!(engine.engine().is_err());
                assert!(engine.counters().is_some());
                (choice, two_d, sums)
            })
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

fn expected() -> Vec<f32> {
    (0..1000).map(|i| (4 * (i % 7) + 6) as f32).collect()
}

#[test]
fn auto_probes_once_connected_and_every_rank_adopts_the_same_choice() {
    let ranks = two_by_two(config(AlgorithmChoice::Auto), Some(2));
    let (line, two_d, _) = &ranks[0];
    let line = line.as_deref().expect("auto ran");
    assert!(line.starts_with("auto: chose"), "{line}");
    assert!(line.contains("channels=2, taking turns"), "{line}");
    assert_eq!(*two_d, line.starts_with("auto: chose 2d"));
    for (rank, (l, t, sums)) in ranks.iter().enumerate() {
        assert_eq!(l.as_deref(), Some(line), "rank {rank}");
        assert_eq!(t, two_d, "rank {rank}");
        assert_eq!(sums, &expected(), "rank {rank}");
    }
}

#[test]
fn a_forced_choice_or_no_2d_groups_runs_no_probe() {
    for (algorithm, intra, two_d) in [
        (AlgorithmChoice::TwoD, Some(2), true),
        (AlgorithmChoice::Auto, None, false),
    ] {
        for (rank, (line, t, sums)) in two_by_two(config(algorithm), intra).into_iter().enumerate()
        {
            assert_eq!(line, None, "{algorithm:?} rank {rank}");
            assert_eq!(t, two_d, "{algorithm:?} rank {rank}");
            assert_eq!(sums, expected(), "{algorithm:?} rank {rank}");
        }
    }
}

#[test]
fn bad_arguments_are_invalid_arguments() {
    let c = config(AlgorithmChoice::Auto);
    let invalid = |r: Result<CommEngine>| match r {
        Err(Error::InvalidArgument(m)) => m,
        Err(e) => panic!("{e}"),
        Ok(_) => panic!("accepted"),
    };
    let err = EngineSetup::new(&c, 4, 4, Placement::default(), None).unwrap_err();
    assert_eq!(err.to_string(), "rank 4 is not a rank of a group of 4");
    let one = EngineSetup::new(&c, 0, 1, Placement::default(), None).unwrap();
    let err = one.clone().with_channels(0).unwrap_err();
    assert_eq!(err.to_string(), "channels must be at least 1");
    assert_eq!(one.clone().with_channels(3).unwrap().num_channels(), 3);
    let m = invalid(CommEngine::new(one.clone(), "localhost", None));
    assert_eq!(m, "host must be an IP address, got \"localhost\"");
    let mut engine = CommEngine::new(one, "127.0.0.1", None).unwrap();
    assert!(engine.engine().is_err());
    let token = random_token().unwrap();
    let two = ["127.0.0.1:1".to_string(), "127.0.0.1:2".to_string()];
    let peers = TcpPeers {
        addresses: &two,
        token: &token,
        intra_addresses: None,
        inter_addresses: None,
    };
    let err = engine.connect(&peers).unwrap_err();
    assert_eq!(
        err.to_string(),
        "expected 1 addresses (one per rank), got 2"
    );
    let err = engine
        .connect(&TcpPeers {
            addresses: &two[..1],
            token: &token[..3],
            ..peers
        })
        .unwrap_err();
    assert_eq!(
        err.to_string(),
        format!("the job token must be {TOKEN_LEN} bytes, got 3")
    );
    let bad = ["nowhere".to_string()];
    let err = engine
        .connect(&TcpPeers {
            addresses: &bad,
            ..peers
        })
        .unwrap_err();
    assert_eq!(err.to_string(), "address #0 \"nowhere\" is not ip:port");
    assert_eq!(
        DeviceTransport::parse("tcp", None).unwrap_err().to_string(),
        "transport 'tcp' needs the host address to listen on"
    );
    assert_eq!(
        DeviceTransport::parse("gloo", Some("127.0.0.1"))
            .unwrap_err()
            .to_string(),
        "transport must be 'nccl' or 'tcp', got \"gloo\""
    );
    assert_eq!(
        DeviceTransport::parse("nccl", None).unwrap(),
        DeviceTransport::Nccl
    );
    assert_eq!(
        DeviceTransport::parse_for("tcp", Some("127.0.0.1"), "cuda")
            .unwrap_err()
            .to_string(),
        "transport 'tcp' runs on CPU tensors, but the kernels are on cuda; \
         CUDA tensors go over TCP through host staging"
    );
    assert_eq!(
        DeviceTransport::parse_for("tcp", Some("127.0.0.1"), "cpu").unwrap(),
        DeviceTransport::Tcp {
            host: "127.0.0.1".into()
        }
    );
    assert_eq!(
        DeviceTransport::parse_for("nccl", None, "cuda").unwrap(),
        DeviceTransport::Nccl
    );
}
