//! Fuzz input = a serialized `tf.train.Example`.
//!
//! On a successful parse, re-encodes with `prost::Message::encode_to_vec` and
//! parses again. Invariants checked:
//!
//! * nothing panics (malformed input must be a typed `MalformedExample`);
//! * the re-parsed Example equals the first parse (floats compared by bit
//!   pattern, so NaN payloads must survive unchanged too);
//! * encoding is stable: the second parse re-encodes to the same bytes, and
//!   `encoded_len` matches the encoded size.
#![no_main]

use libfuzzer_sys::fuzz_target;
use prost::Message;
use tiacc_core::tfrecord::example::{Example, Kind};
use tiacc_core::Error;

/// `PartialEq` for Example, except that floats compare by bits (NaN != NaN
/// under `==`, which would make any NaN input a false positive).
fn same(a: &Example, b: &Example) -> bool {
    let (fa, fb) = (a.features.as_ref(), b.features.as_ref());
    if fa.is_some() != fb.is_some() {
        return false;
    }
    let (Some(fa), Some(fb)) = (fa, fb) else { return true };
    fa.feature.len() == fb.feature.len()
        && fa.feature.iter().zip(&fb.feature).all(|((ka, va), (kb, vb))| {
            ka == kb
                && match (&va.kind, &vb.kind) {
                    (None, None) => true,
                    (Some(Kind::BytesList(x)), Some(Kind::BytesList(y))) => x == y,
                    (Some(Kind::Int64List(x)), Some(Kind::Int64List(y))) => x == y,
                    (Some(Kind::FloatList(x)), Some(Kind::FloatList(y))) => {
                        x.value.len() == y.value.len()
                            && x.value.iter().zip(&y.value).all(|(p, q)| p.to_bits() == q.to_bits())
                    }
                    _ => false,
                }
        })
}

fuzz_target!(|data: &[u8]| {
    let first = match Example::parse(data.to_vec(), "") {
        Ok(ex) => ex,
        Err(Error::MalformedExample { .. }) => return,
        Err(other) => panic!("unexpected error kind: {other:?}"),
    };
    let encoded = first.encode_to_vec();
    assert_eq!(encoded.len(), first.encoded_len());
    let second = Example::parse(encoded.clone(), "").expect("re-encoded Example does not parse");
    assert!(same(&first, &second), "roundtrip changed the Example:\n{first:?}\n{second:?}");
    assert_eq!(second.encode_to_vec(), encoded, "encoding is not stable");
});
