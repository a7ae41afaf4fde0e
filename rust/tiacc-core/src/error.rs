//! The one typed error of the engine. Every variant names the file, offset,
//! line or variable involved so that the message alone locates the problem.

use std::path::PathBuf;

/// Result alias used throughout the engine.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Every failure the engine can report.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The operating system refused an operation on `path`.
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    /// A TFRecord whose framing or checksums are wrong.
    #[error("{}: corrupt record at offset {offset}: {kind}", path.display())]
    CorruptRecord {
        path: PathBuf,
        offset: u64,
        kind: Corruption,
    },

    /// A file that changed on disk after it was opened (rewritten,
    /// truncated, deleted or replaced): the offsets its reader was given no
    /// longer describe it, so nothing more is read from it.
    #[error("{}: cannot read the record at offset {offset}: the file changed after it was opened ({change}); open it again (a new dataset) to read the new file", path.display())]
    FileChanged {
        path: PathBuf,
        offset: u64,
        change: String,
    },

    /// A record payload that is not a valid `tf.train.Example`.
    #[error("malformed tf.train.Example{location}: {reason}")]
    MalformedExample {
        /// " in FILE at offset N" when the payload came from a file, else "".
        location: String,
        reason: String,
    },

    /// A malformed line in an index file.
    #[error("{}:{line}: {reason}", path.display())]
    BadIndex {
        path: PathBuf,
        /// 1-based line number.
        line: usize,
        reason: String,
    },

    /// An index line names a shard that cannot be opened (missing, or not
    /// readable): the index is fine, the dataset it describes is incomplete.
    #[error("{}:{line}: {reason}", index.display())]
    MissingShard {
        /// The index file.
        index: PathBuf,
        /// 1-based line number of the first line naming the shard.
        line: usize,
        /// The shard the line names, resolved against the index's folder.
        shard: PathBuf,
        /// Why the shard cannot be opened (`NotFound`, `PermissionDenied`, ...).
        kind: std::io::ErrorKind,
        reason: String,
    },

    /// A file that is not a readable image.
    #[error("{}: not a readable image: {reason}", path.display())]
    BadImage { path: PathBuf, reason: String },

    /// A record whose image cannot be decoded.
    #[error("{}: record at offset {offset} (dataset index {index}): image is not decodable: {reason}", path.display())]
    RecordImage {
        path: PathBuf,
        offset: u64,
        index: usize,
        reason: String,
    },

    /// A record that lacks a feature the dataset needs, or has it with the
    /// wrong type.
    #[error("{}: record at offset {offset} (dataset index {index}): {reason}", path.display())]
    RecordFeature {
        path: PathBuf,
        offset: u64,
        index: usize,
        reason: String,
    },

    /// A caller passed a value the engine cannot use.
    #[error("{0}")]
    InvalidArgument(String),

    /// A configuration value (environment variable or argument) is invalid.
    #[error("{variable}={value:?} is invalid: expected {expected}")]
    Config {
        variable: String,
        value: String,
        expected: String,
    },

    /// A collective failed: a peer closed its connection, sent something
    /// unexpected, or issued a different collective than this rank.
    #[error("{message}")]
    Comm {
        /// The rank whose connection or data caused the failure, if one did.
        peer: Option<usize>,
        message: String,
    },

    /// A peer did not answer within the communication timeout.
    #[error("{message}")]
    CommTimeout { peer: usize, message: String },

    /// The key-value store of the ranks' rendezvous
    /// ([`crate::comm::Store`]) failed on `key`.
    #[error("the rendezvous store failed on key {key}: {reason}")]
    Store { key: String, reason: String },

    /// An engine's state across steps (a checkpoint's Top-K buffers and
    /// step counts, [`crate::comm::state`]) that does not fit the engine it
    /// is loaded into: `key` names what differs (`rank`, `world size`,
    /// `setting topk_ratio`, `bucket 3 velocity`, ...), `expected` is this
    /// engine's value, `found` the state's.
    #[error(
        "the engine state does not fit this engine: {key}: expected {expected}, found {found}"
    )]
    StateMismatch {
        key: String,
        expected: String,
        found: String,
    },

    /// A collective called by a name, reduction or buffer its engine does
    /// not take ([`crate::comm::collective`]).
    #[error(transparent)]
    Collective(#[from] CollectiveError),
}

/// What is wrong with a collective's call ([`crate::comm::collective`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CollectiveError {
    /// A name the engine does not run; `expected` lists those it does.
    #[error("unknown collective {name:?}: expected {expected}")]
    Unknown { name: String, expected: String },
    /// A reduction other than sum or avg on the device engine.
    #[error("the device engine reduces with sum or avg, not {0:?}")]
    DeviceReduce(String),
    /// A broadcast's root that is not one of the ranks.
    #[error("root {root} is not a rank of a group of {size}")]
    NotARank { root: usize, size: usize },
    /// A buffer that does not hold one equal block per rank.
    #[error("{collective}: {elements} {dtype} elements do not split into {size} equal blocks")]
    UnequalBlocks {
        collective: &'static str,
        elements: usize,
        dtype: &'static str,
        size: usize,
    },
    /// An average of an element type that has none (bool).
    #[error("allreduce: an average of {dtype} elements has no meaning")]
    NoAverage { dtype: &'static str },
}

/// What exactly is wrong with a corrupt record.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Corruption {
    /// The file ends inside the 12-byte record header.
    #[error(
        "truncated header: the file ends {available} bytes after the offset, a header needs 12"
    )]
    TruncatedHeader { available: u64 },
    /// The masked CRC32C stored after the length does not match it.
    #[error("length CRC mismatch (stored {stored:#010x}, computed {computed:#010x})")]
    LengthCrc { stored: u32, computed: u32 },
    /// The length field asks for more bytes than the file holds after the header.
    #[error("length field says {length} payload bytes (+4 CRC bytes) but only {available} bytes remain in the file (truncated or corrupt)")]
    LengthPastEnd { length: u64, available: u64 },
    /// The masked CRC32C stored after the payload does not match it.
    #[error("payload CRC mismatch over {length} bytes (stored {stored:#010x}, computed {computed:#010x})")]
    PayloadCrc {
        length: u64,
        stored: u32,
        computed: u32,
    },
    /// The offset is beyond the end of the file.
    #[error("offset is past the end of the file ({file_len} bytes)")]
    OffsetPastEnd { file_len: u64 },
    /// The offset lies inside a record instead of at its first byte.
    #[error("offset is not a record boundary (the nearest record before it starts at {previous})")]
    NotRecordBoundary { previous: u64 },
}

impl Error {
    /// The kind of operating-system error behind this error, if one is: an
    /// unreadable file, or a shard an index names that cannot be opened.
    pub fn io_kind(&self) -> Option<std::io::ErrorKind> {
        match self {
            Error::Io { source, .. } => Some(source.kind()),
            Error::MissingShard { kind, .. } => Some(*kind),
            _ => None,
        }
    }

    /// Wraps an I/O error with the path it concerns.
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io {
            path: path.into(),
            source,
        }
    }
}
