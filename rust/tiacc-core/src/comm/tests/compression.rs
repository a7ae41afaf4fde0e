//! The engine's half-precision compression and its NaN check.

use super::*;

/// An integer `2..=6` or `-6..=-2` off by a small fraction (below half the
/// wire type's spacing there, so the cast rounds it to the integer, up or
/// down), for rank `rank`'s element `i`.
fn off_integer(wire: DType, rank: usize, i: usize) -> f64 {
    let m = (i * 7 + rank * 3) % 10;
    let j = if m < 5 {
        -(m as f64) - 2.0
    } else {
        m as f64 - 3.0
    };
    // 2^-12 is below half the float16 spacing at 2 (2^-10); 2^-9 below half
    // bfloat16's (2^-7).
    let delta = if wire == DType::F16 {
        2f64.powi(-12)
    } else {
        2f64.powi(-9)
    };
    let s = if (i + rank) % 3 == 0 { -1.0 } else { 1.0 };
    j + s * delta
}

#[test]
fn half_precision_compression_averages_within_its_precision() {
    use crate::comm::codec::Compression;
    for compression in [Compression::Fp16, Compression::Bf16] {
        let options = AlgoSettings {
            compression,
            scale: 4.0,
            ..Default::default()
        };
        let p = 3;
        let results = with_engines(p, 2, options, |rank, engine| {
            let values: Vec<f64> = (0..5000)
                .map(|i| ((i + rank * 7) as f64).sin() * 100.0)
                .collect();
            allreduce_f32(engine, &values, true, 3)
        });
        for (i, got) in results[0].iter().enumerate() {
            let mean: f64 = (0..p)
                .map(|r| ((i + r * 7) as f64).sin() * 100.0)
                .sum::<f64>()
                / p as f64;
            let tolerance = if compression == Compression::Bf16 {
                2.0
            } else {
                0.2
            };
            assert!(
                (got - mean).abs() < tolerance,
                "{compression:?} {i}: {got} vs {mean}"
            );
        }
        assert!(results.iter().all(|r| r == &results[0]), "ranks differ");
        // The values went through the half type: most means are off by
        // more than float32's rounding of them (a mutant that sends float32
        // keeps every one within about 1e-5).
        let off = results[0]
            .iter()
            .enumerate()
            .filter(|&(i, got)| {
                let mean: f64 = (0..p)
                    .map(|r| ((i + r * 7) as f64).sin() * 100.0)
                    .sum::<f64>()
                    / p as f64;
                (got - mean).abs() > 1e-3
            })
            .count();
        assert!(
            off > 5000 / 2,
            "{compression:?}: only {off} of 5000 rounded"
        );
    }
}

#[test]
fn half_precision_compression_sums_each_ranks_share_rounded_to_the_wire_type() {
    // 4 ranks averaging with scale 2: each rank's share is x * 2 / 4, cast
    // to the wire type (rounded to an integer by construction), summed
    // (integers: exact in any order) and divided by 2. The exact mean
    // differs from that wherever the fractions do not cancel.
    let (p, len, scale) = (4usize, 3001usize, 2.0);
    for wire in [DType::F16, DType::BF16] {
        let settings = AlgoSettings {
            compression: compression_for(wire),
            scale,
            ..Default::default()
        };
        let input = move |r: usize, i: usize| 2.0 * off_integer(wire, r, i);
        let results = with_engines(p, 2, settings, move |rank, engine| {
            let values: Vec<f64> = (0..len).map(|i| input(rank, i)).collect();
            allreduce_f32(engine, &values, true, 3)
        });
        let factor = scale / p as f64;
        let mut rounded = 0;
        for i in 0..len {
            let shares: Vec<f64> = (0..p)
                .map(|r| round_to(wire, input(r, i) * factor))
                .collect();
            assert!(
                shares.iter().all(|v| v.fract() == 0.0),
                "{wire:?} {i}: {shares:?}"
            );
            let want = (shares.iter().sum::<f64>() / scale) as f32 as f64;
            let exact = (0..p).map(|r| input(r, i)).sum::<f64>() / p as f64;
            for (rank, got) in results.iter().enumerate() {
                assert_eq!(got[i], want, "{wire:?} rank {rank} element {i}");
            }
            if results[0][i] != exact {
                rounded += 1;
            }
        }
        // Every element whose fractions do not cancel (3 of 4 do not).
        assert!(
            rounded > len / 2,
            "{wire:?}: only {rounded} of {len} rounded"
        );
    }
}

#[test]
fn the_nan_check_stops_a_bucket_before_it_is_sent_and_names_the_rank() {
    let options = AlgoSettings {
        nan_check: true,
        ..Default::default()
    };
    let errors = with_engines(3, 2, options, |rank, engine| {
        let mut values = vec![1.0; 100];
        if rank == 1 {
            values[42] = f64::NAN;
        }
        let mut buf = encode(DType::F32, &values);
        let err = engine
            .run(
                Collective::Allreduce { average: false },
                &mut buf,
                DType::F32,
                5,
            )
            .unwrap_err();
        (err.to_string(), decode(DType::F32, &buf))
    });
    let (msg, buf) = &errors[1];
    assert!(
        msg.contains("rank 1: bucket 5 holds a non-finite gradient"),
        "{msg}"
    );
    assert!(msg.contains("element 42"), "{msg}");
    // The other ranks fail too and their buffers never saw the NaN.
    for (rank, (msg, buf)) in errors.iter().enumerate() {
        if rank != 1 {
            assert!(msg.contains("rank"), "{msg}");
            assert!(
                buf.iter().all(|v| v.is_finite()),
                "rank {rank} received the NaN"
            );
        }
    }
    assert!(buf[42].is_nan());
}
