//! `tf.train.Example` as hand-written prost messages.
//!
//! Field numbers follow tensorflow/core/example/{example,feature}.proto.
//! prost accepts both packed and unpacked encodings of repeated scalars when
//! decoding, as the protobuf spec requires, and writes packed ones (as
//! TensorFlow does). Feature maps are `BTreeMap`s so that the same features
//! always serialize to the same bytes.

use std::collections::BTreeMap;

use bytes::Bytes;
use prost::Message;

use crate::error::{Error, Result};

/// `tf.train.BytesList`.
#[derive(Clone, PartialEq, Message)]
pub struct BytesList {
    #[prost(bytes = "bytes", repeated, tag = "1")]
    pub value: Vec<Bytes>,
}

/// `tf.train.FloatList`.
#[derive(Clone, PartialEq, Message)]
pub struct FloatList {
    #[prost(float, repeated, tag = "1")]
    pub value: Vec<f32>,
}

/// `tf.train.Int64List`.
#[derive(Clone, PartialEq, Message)]
pub struct Int64List {
    #[prost(int64, repeated, tag = "1")]
    pub value: Vec<i64>,
}

/// `tf.train.Feature`: one of the three list kinds (or none).
#[derive(Clone, PartialEq, Message)]
pub struct Feature {
    #[prost(oneof = "Kind", tags = "1, 2, 3")]
    pub kind: Option<Kind>,
}

/// The `kind` oneof of `tf.train.Feature`.
#[derive(Clone, PartialEq, prost::Oneof)]
pub enum Kind {
    #[prost(message, tag = "1")]
    BytesList(BytesList),
    #[prost(message, tag = "2")]
    FloatList(FloatList),
    #[prost(message, tag = "3")]
    Int64List(Int64List),
}

/// `tf.train.Features`: a map from feature name to feature.
#[derive(Clone, PartialEq, Message)]
pub struct Features {
    #[prost(btree_map = "string, message", tag = "1")]
    pub feature: BTreeMap<String, Feature>,
}

/// `tf.train.Example`.
#[derive(Clone, PartialEq, Message)]
pub struct Example {
    #[prost(message, optional, tag = "1")]
    pub features: Option<Features>,
}

impl Feature {
    /// A `BytesList` feature.
    pub fn bytes<I, B>(values: I) -> Self
    where
        I: IntoIterator<Item = B>,
        B: Into<Bytes>,
    {
        Feature {
            kind: Some(Kind::BytesList(BytesList {
                value: values.into_iter().map(Into::into).collect(),
            })),
        }
    }

    /// An `Int64List` feature.
    pub fn int64(values: impl IntoIterator<Item = i64>) -> Self {
        Feature {
            kind: Some(Kind::Int64List(Int64List {
                value: values.into_iter().collect(),
            })),
        }
    }

    /// A `FloatList` feature.
    pub fn float(values: impl IntoIterator<Item = f32>) -> Self {
        Feature {
            kind: Some(Kind::FloatList(FloatList {
                value: values.into_iter().collect(),
            })),
        }
    }
}

impl Example {
    /// Builds an Example from `(name, feature)` pairs.
    pub fn from_features<K: Into<String>>(
        features: impl IntoIterator<Item = (K, Feature)>,
    ) -> Self {
        Example {
            features: Some(Features {
                feature: features.into_iter().map(|(k, v)| (k.into(), v)).collect(),
            }),
        }
    }

    /// Parses a serialized Example. `location` (e.g. `" in a.tfrecord at
    /// offset 12"`) is put into the error message.
    pub fn parse(payload: impl Into<Bytes>, location: &str) -> Result<Self> {
        Example::decode(payload.into()).map_err(|e| Error::MalformedExample {
            location: location.to_string(),
            reason: e.to_string(),
        })
    }

    /// The feature map (empty if the Example has no `features`).
    pub fn feature_map(&self) -> impl Iterator<Item = (&String, &Feature)> {
        self.features.iter().flat_map(|f| f.feature.iter())
    }

    /// The feature called `name`, if present.
    pub fn get(&self, name: &str) -> Option<&Feature> {
        self.features.as_ref().and_then(|f| f.feature.get(name))
    }

    /// The first value of an `Int64List` feature, if it is one and non-empty.
    pub fn first_int64(&self, name: &str) -> Option<i64> {
        match self.get(name)?.kind.as_ref()? {
            Kind::Int64List(list) => list.value.first().copied(),
            _ => None,
        }
    }

    /// The first value of a `BytesList` feature, if it is one and non-empty.
    pub fn first_bytes(&self, name: &str) -> Option<&Bytes> {
        match self.get(name)?.kind.as_ref()? {
            Kind::BytesList(list) => list.value.first(),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Example {
        Example::from_features([
            ("image/encoded", Feature::bytes([b"\xff\xd8jpeg".to_vec()])),
            ("image/class/label", Feature::int64([7])),
            ("scores", Feature::float([0.5, -1.25])),
            ("empty", Feature::int64([])),
        ])
    }

    #[test]
    fn roundtrip() {
        let ex = sample();
        let bytes = ex.encode_to_vec();
        let back = Example::parse(bytes, "").unwrap();
        assert_eq!(back, ex);
        assert_eq!(back.first_int64("image/class/label"), Some(7));
        assert_eq!(
            back.first_bytes("image/encoded").unwrap().as_ref(),
            b"\xff\xd8jpeg"
        );
        assert_eq!(back.first_int64("scores"), None);
    }

    #[test]
    fn encoding_is_deterministic_and_sorted() {
        let a = sample().encode_to_vec();
        let b = Example::from_features([
            ("scores", Feature::float([0.5, -1.25])),
            ("empty", Feature::int64([])),
            ("image/class/label", Feature::int64([7])),
            ("image/encoded", Feature::bytes([b"\xff\xd8jpeg".to_vec()])),
        ])
        .encode_to_vec();
        assert_eq!(a, b);
    }

    /// Hand-encoded protobuf bytes: Example{features{feature{"x": int64_list
    /// [1, 2]}}} with the Int64List written unpacked (tag 1, varint, twice).
    #[test]
    fn unpacked_repeated_fields_decode() {
        let int64_list = [0x08, 0x01, 0x08, 0x02]; // field 1 varint 1, field 1 varint 2
        let float_list = [0x0d, 0x00, 0x00, 0x80, 0x3f]; // field 1 fixed32 1.0
        for (kind_tag, list, expected) in [
            (0x1a_u8, &int64_list[..], Feature::int64([1, 2])),
            (0x12_u8, &float_list[..], Feature::float([1.0])),
        ] {
            let mut feature = vec![kind_tag, list.len() as u8];
            feature.extend_from_slice(list);
            let mut entry = vec![0x0a, 0x01, b'x', 0x12, feature.len() as u8];
            entry.extend_from_slice(&feature);
            let mut features = vec![0x0a, entry.len() as u8];
            features.extend_from_slice(&entry);
            let mut example = vec![0x0a, features.len() as u8];
            example.extend_from_slice(&features);
            let parsed = Example::parse(example, "").unwrap();
            assert_eq!(parsed.get("x"), Some(&expected));
        }
    }

    #[test]
    fn packed_encoding_is_what_we_write() {
        let bytes = Feature::int64([1, 2]).encode_to_vec();
        // Feature.int64_list (field 3, LEN) -> Int64List.value packed (field 1, LEN).
        assert_eq!(bytes, vec![0x1a, 0x04, 0x0a, 0x02, 0x01, 0x02]);
    }

    #[test]
    fn malformed_payload_is_an_error_with_location() {
        let err = Example::parse(vec![0x0a, 0x05, 0x01], " in f.tfrecord at offset 9").unwrap_err();
        let msg = err.to_string();
        assert!(matches!(err, Error::MalformedExample { .. }));
        assert!(msg.contains("in f.tfrecord at offset 9"), "{msg}");
    }
}
