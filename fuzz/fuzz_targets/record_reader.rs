//! Fuzz input = the bytes of a TFRecord file.
//!
//! Scans the whole buffer and reads records at offsets derived from the
//! input, with and without CRC verification, and parses every payload that
//! was read as a `tf.train.Example`. Invariants checked:
//!
//! * nothing panics;
//! * scanned offsets start at 0, strictly increase and are contiguous (each
//!   record starts where the previous one ended), and every record lies
//!   inside the file;
//! * with verify=true, every `Ok` payload re-frames (`record::frame`) to
//!   exactly the file bytes at its offset; with verify=false, the payload is
//!   exactly the bytes after the 12-byte header and the header's length field
//!   matches it;
//! * `read_at(offset)` agrees with `scan` on scanned offsets, and `read_into`
//!   with a dirty reused buffer agrees with `read_at`;
//! * an in-memory source only ever fails with `Error::CorruptRecord` naming
//!   the offset that was asked for (never `Io`: that would mean a read went
//!   out of bounds after the header checks passed);
//! * the offsets a verified scan accepts are a prefix of those an unverified
//!   scan accepts, with identical payloads.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tiacc_core::tfrecord::example::Example;
use tiacc_core::tfrecord::record::{frame, RecordReader, FRAME_OVERHEAD, HEADER_LEN};
use tiacc_core::Error;

/// Checks that `payload`, read at `offset`, is what the file holds there.
fn check_payload(data: &[u8], offset: u64, payload: &[u8], verify: bool) {
    let start = offset as usize;
    let end = offset
        .checked_add(FRAME_OVERHEAD + payload.len() as u64)
        .expect("record end overflows u64");
    assert!(end <= data.len() as u64, "record at {offset} runs past the end");
    let region = &data[start..end as usize];
    if verify {
        assert_eq!(frame(payload), region, "verified payload at {offset} does not re-frame");
    } else {
        let h = HEADER_LEN as usize;
        assert_eq!(&region[..8], &(payload.len() as u64).to_le_bytes());
        assert_eq!(&region[h..h + payload.len()], payload);
    }
    // Must not panic; Ok or a typed error are both fine.
    let _ = Example::parse(payload.to_vec(), "");
}

fn check_err(err: &Error, offset: u64) {
    match err {
        Error::CorruptRecord { offset: at, .. } => {
            assert_eq!(*at, offset, "error names the wrong offset: {err}")
        }
        other => panic!("unexpected error kind at offset {offset}: {other:?}"),
    }
}

/// Full scan; returns the `(offset, payload)` pairs read before the first error.
fn scan(data: &[u8], verify: bool) -> Vec<(u64, Vec<u8>)> {
    let reader = RecordReader::from_source(data.to_vec(), "fuzz.tfrecord", verify);
    assert_eq!(reader.size(), data.len() as u64);
    let mut records = Vec::new();
    let mut expected_at = 0u64;
    let mut scan = reader.scan();
    while let Some(item) = scan.next() {
        match item {
            Ok((at, payload)) => {
                if let Some((prev, _)) = records.last() {
                    assert!(at > *prev, "scan offsets not increasing: {prev} then {at}");
                }
                assert_eq!(at, expected_at, "scan skipped or overlapped bytes");
                check_payload(data, at, &payload, verify);
                expected_at = at + FRAME_OVERHEAD + payload.len() as u64;
                assert_eq!(scan.offset(), expected_at);
                records.push((at, payload));
            }
            Err(e) => {
                check_err(&e, expected_at);
                assert!(scan.next().is_none(), "scan continued after an error");
                return records;
            }
        }
    }
    // A clean end means the records cover the file exactly.
    assert_eq!(expected_at, data.len() as u64, "scan ended early without error");
    records
}

fn probe(data: &[u8], verify: bool, scanned: &[(u64, Vec<u8>)]) {
    let reader = RecordReader::from_source(data.to_vec(), "fuzz.tfrecord", verify);
    let len = data.len() as u64;
    let mut offsets: Vec<u64> = scanned.iter().map(|(at, _)| *at).collect();
    offsets.extend([0, len, len.saturating_sub(1), len.saturating_sub(HEADER_LEN), u64::MAX]);
    if data.len() >= 8 {
        let head = u64::from_le_bytes(data[..8].try_into().unwrap());
        let tail = u64::from_le_bytes(data[data.len() - 8..].try_into().unwrap());
        offsets.extend([head, head % (len + 1), tail % (len + 1)]);
    }
    let mut buf = vec![0xa5u8; 37];
    for off in offsets {
        let res = reader.read_at(off);
        match &res {
            Ok(payload) => {
                check_payload(data, off, payload, verify);
                if let Some((_, p)) = scanned.iter().find(|(at, _)| *at == off) {
                    assert_eq!(p, payload, "read_at disagrees with scan at {off}");
                }
            }
            Err(e) => check_err(e, off),
        }
        match (reader.read_into(off, &mut buf), &res) {
            (Ok(next), Ok(payload)) => {
                assert_eq!(&buf, payload, "read_into disagrees with read_at at {off}");
                assert_eq!(next, off + FRAME_OVERHEAD + payload.len() as u64);
            }
            (Err(_), Err(_)) => {}
            (a, b) => panic!("read_into and read_at disagree at {off}: {a:?} vs {b:?}"),
        }
    }
}

fuzz_target!(|data: &[u8]| {
    let verified = scan(data, true);
    let unverified = scan(data, false);
    assert!(
        verified.len() <= unverified.len() && verified[..] == unverified[..verified.len()],
        "verified scan is not a prefix of the unverified scan"
    );
    probe(data, true, &verified);
    probe(data, false, &unverified);
});
