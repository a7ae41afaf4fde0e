//! The TCP ring: every collective, several channels, a rank that
//! disagrees, a silent or dead peer, and the rendezvous.

use super::*;

#[test]
fn allreduce_sums_every_dtype_and_size_identically_on_every_rank() {
    for p in 1..=5 {
        for dtype in [DType::F32, DType::F64, DType::F16, DType::BF16] {
            for len in [0usize, 1, 3, p + 1, 1000, 40_003] {
                let results = on_every_rank(p, move |rank, ring| {
                    let mut buf = encode(dtype, &rank_values(rank, len));
                    ring.allreduce(&mut buf, dtype, deadline()).unwrap();
                    buf
                });
                let inputs: Vec<Vec<f64>> = (0..p).map(|r| rank_values(r, len)).collect();
                let expected: Vec<f64> = (0..len)
                    .map(|i| inputs.iter().map(|v| v[i]).sum())
                    .collect();
                assert_eq!(
                    decode(dtype, &results[0]),
                    expected,
                    "p={p} {dtype:?} len={len}"
                );
                for other in &results[1..] {
                    assert_eq!(
                        other, &results[0],
                        "ranks differ: p={p} {dtype:?} len={len}"
                    );
                }
            }
        }
    }
}

#[test]
fn float_sums_are_bitwise_identical_across_ranks() {
    // Values whose sum depends on the order of additions.
    let results = on_every_rank(4, |rank, ring| {
        let values: Vec<f64> = (0..10_001)
            .map(|i| ((i * 31 + rank) as f64).sin() * 1e3)
            .collect();
        let mut buf = encode(DType::F32, &values);
        ring.allreduce(&mut buf, DType::F32, deadline()).unwrap();
        buf
    });
    assert!(results.iter().all(|r| r == &results[0]));
    // And the sum itself, within float32's rounding of 3 additions.
    for (i, got) in decode(DType::F32, &results[0]).iter().enumerate() {
        let want: f64 = (0..4)
            .map(|rank| (((i * 31 + rank) as f64).sin() * 1e3) as f32 as f64)
            .sum();
        assert!((got - want).abs() < 1e-3, "{i}: {got} vs {want}");
    }
}

#[test]
fn reduce_scatter_allgather_broadcast_barrier() {
    let p = 3;
    let len = 10;
    let results = on_every_rank(p, move |rank, ring| {
        let mut rs = encode(DType::F64, &rank_values(rank, len));
        ring.reduce_scatter(&mut rs, DType::F64, deadline())
            .unwrap();
        let mine = shard_range(len, p, rank);
        let rs_shard = decode(DType::F64, &rs[mine.start * 8..mine.end * 8]);

        let mut ag = vec![0u8; len];
        for i in shard_range(len, p, rank) {
            ag[i] = (rank * 10 + i) as u8;
        }
        ring.allgather(&mut ag, 1, deadline()).unwrap();

        let mut bc = if rank == 1 {
            vec![42u8; 100_000]
        } else {
            vec![0u8; 100_000]
        };
        ring.broadcast(&mut bc, 1, deadline()).unwrap();
        ring.barrier(deadline()).unwrap();
        (rs_shard, ag, bc)
    });
    for (rank, (rs_shard, ag, bc)) in results.iter().enumerate() {
        let mine = shard_range(len, p, rank);
        let expected: Vec<f64> = mine
            .clone()
            .map(|i| (0..p).map(|r| rank_values(r, len)[i]).sum())
            .collect();
        assert_eq!(rs_shard, &expected);
        for owner in 0..p {
            for i in shard_range(len, p, owner) {
                assert_eq!(ag[i], (owner * 10 + i) as u8);
            }
        }
        assert!(bc.iter().all(|&b| b == 42));
    }
}

#[test]
fn several_channels_carry_independent_collectives() {
    let p = 3;
    let results = with_engines(p, 3, Default::default(), |rank, engine| {
        (0..7u64)
            .map(|bucket| {
                let len = 1000 + bucket as usize * 517;
                allreduce_f32(
                    engine,
                    &rank_values(rank + bucket as usize, len),
                    true,
                    bucket,
                )
            })
            .collect::<Vec<_>>()
    });
    for (bucket, got) in results[0].iter().enumerate() {
        let len = got.len();
        let inputs: Vec<Vec<f64>> = (0..p).map(|r| rank_values(r + bucket, len)).collect();
        for (i, v) in got.iter().enumerate() {
            let sum: f64 = inputs.iter().map(|x| x[i] / p as f64).sum();
            assert!(
                (v - sum).abs() < 1e-5,
                "bucket {bucket} element {i}: {v} vs {sum}"
            );
        }
        for other in &results[1..] {
            assert_eq!(&other[bucket], got);
        }
    }
}

#[test]
fn mismatched_collectives_raise_on_every_rank_naming_the_odd_rank() {
    let errors = on_every_rank(3, |rank, ring| {
        let bytes = if rank == 2 { 400 } else { 800 };
        let tag = allreduce_tag(1, 0, DType::F32, bytes);
        ring.agree(&tag, deadline()).unwrap_err().to_string()
    });
    for msg in &errors {
        assert!(msg.contains("rank 2 issued"), "{msg}");
        assert!(msg.contains("400 bytes"), "{msg}");
    }
}

#[test]
fn checked_allreduce_sums_and_catches_a_diverging_rank_without_an_extra_round() {
    let tag = |bytes: u64| allreduce_tag(1, 4, DType::F32, bytes);
    let sums = on_every_rank(3, move |rank, ring| {
        let mut buf = encode(DType::F32, &rank_values(rank, 100));
        let tag = tag(400);
        ring.allreduce_with(&mut buf, &summing(Some(&tag), DType::F32, 1.0, 0))
            .unwrap();
        decode(DType::F32, &buf)
    });
    let want: Vec<f64> = (0..100)
        .map(|i| (0..3).map(|r| rank_values(r, 100)[i]).sum())
        .collect();
    for (rank, got) in sums.iter().enumerate() {
        assert_eq!(got, &want, "rank {rank}");
    }

    let errors = on_every_rank(3, move |rank, ring| {
        let len = if rank == 1 { 90 } else { 100 };
        let mut buf = encode(DType::F32, &rank_values(rank, len));
        let tag = tag(len as u64 * 4);
        let err = ring
            .allreduce_with(&mut buf, &summing(Some(&tag), DType::F32, 1.0, 0))
            .unwrap_err();
        ring.abort(); // what the engine does after a failure
        err.to_string()
    });
    // Rank 2 reads rank 1's header and names it; the others fail because
    // the ring was aborted.
    assert!(errors[2].contains("rank 1 issued"), "{}", errors[2]);
    assert!(errors[2].contains("360 bytes"), "{}", errors[2]);
    for msg in &errors {
        assert!(msg.contains("rank"), "{msg}");
    }
}

#[test]
fn a_silent_peer_times_out_naming_it() {
    let mut per_rank = rings(2, 1);
    let mut silent = per_rank.pop().unwrap();
    let mut ring = per_rank.pop().unwrap().remove(0);
    let start = Instant::now();
    let mut buf = vec![0u8; 4096];
    let err = ring
        .allreduce(
            &mut buf,
            DType::F32,
            Deadline::after(Duration::from_millis(300)),
        )
        .unwrap_err();
    assert!(start.elapsed() < Duration::from_secs(5));
    match &err {
        Error::CommTimeout { peer, message } => {
            assert_eq!(*peer, 1);
            assert!(message.contains("waiting for rank 1"), "{message}");
        }
        other => panic!("expected a timeout, got {other}"),
    }
    // The ring is now broken for good, and says why.
    let again = ring
        .allreduce(&mut buf, DType::F32, deadline())
        .unwrap_err();
    assert!(again.to_string().contains("earlier failure"), "{again}");
    drop(silent.pop());
}

#[test]
fn a_dead_peer_fails_the_others_quickly() {
    let per_rank = rings(3, 1);
    let mut handles = Vec::new();
    for (rank, mut chans) in per_rank.into_iter().enumerate() {
        handles.push(std::thread::spawn(move || {
            let mut ring = chans.remove(0);
            if rank == 2 {
                drop(ring); // the process died: its sockets close
                return None;
            }
            let mut buf = vec![0u8; 1 << 20];
            let start = Instant::now();
            let err = ring
                .allreduce(&mut buf, DType::F32, deadline())
                .unwrap_err();
            ring.abort(); // what the engine does after a failure
            Some((err.to_string(), start.elapsed()))
        }));
    }
    let results: Vec<_> = handles
        .into_iter()
        .filter_map(|h| h.join().unwrap())
        .collect();
    assert_eq!(results.len(), 2);
    for (msg, took) in results {
        assert!(took < Duration::from_secs(10), "{msg}");
        assert!(msg.contains("rank 2") || msg.contains("rank 1"), "{msg}");
        assert!(msg.contains("exited or failed"), "{msg}");
    }
}

#[test]
fn a_connection_with_the_wrong_token_is_dropped_and_rendezvous_goes_on() {
    let token = random_token().unwrap();
    let (ls, addrs) = listeners(2);
    // A stranger reaches rank 1's port before rank 0 does.
    let mut stranger = TcpStream::connect(addrs[1]).unwrap();
    let mut hello = b"TIACCv1\0".to_vec();
    hello.extend_from_slice(&[0u8; 16]);
    hello.extend_from_slice(&[0u8; 12]);
    stranger.write_all(&hello).unwrap();

    let sums = on_listeners(ls, &addrs, move |rank, l, addrs| {
        let mut rings = l.connect(addrs, rank, &token, 1, deadline()).unwrap();
        let mut buf = encode(DType::F32, &[rank as f64 + 1.0]);
        rings[0]
            .allreduce(&mut buf, DType::F32, deadline())
            .unwrap();
        decode(DType::F32, &buf)
    });
    for sum in sums {
        assert_eq!(sum, vec![3.0]);
    }
    stranger
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    let mut byte = [0u8; 1];
    let n = stranger.read(&mut byte).unwrap_or(0);
    assert_eq!(n, 0, "the stranger's connection must be closed");
}

#[test]
fn rendezvous_times_out_when_a_rank_never_shows_up() {
    let token = random_token().unwrap();
    let (mut ls, addrs) = listeners(2);
    let _absent = ls.pop().unwrap(); // listens, never connects
    let l = ls.pop().unwrap();
    let err = l
        .connect(
            &addrs,
            0,
            &token,
            1,
            Deadline::after(Duration::from_millis(300)),
        )
        .unwrap_err();
    assert!(matches!(err, Error::CommTimeout { peer: 1, .. }), "{err}");
}
