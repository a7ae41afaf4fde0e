//! Record framing: encoding, and positional reading with CRC verification.

use std::fs::{File, Metadata};
use std::io::{self, Write};
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::{Path, PathBuf};

use super::crc::masked_crc32c;
use crate::error::{Corruption, Error, Result};

/// Bytes before the payload: u64 length + u32 masked CRC of the length.
pub const HEADER_LEN: u64 = 12;
/// Bytes after the payload: u32 masked CRC of the payload.
pub const FOOTER_LEN: u64 = 4;
/// Framing bytes added to every payload.
pub const FRAME_OVERHEAD: u64 = HEADER_LEN + FOOTER_LEN;

/// The 12 header bytes that precede a payload of `len` bytes.
pub fn encode_header(len: u64) -> [u8; HEADER_LEN as usize] {
    let len_bytes = len.to_le_bytes();
    let mut header = [0u8; HEADER_LEN as usize];
    header[..8].copy_from_slice(&len_bytes);
    header[8..].copy_from_slice(&masked_crc32c(&len_bytes).to_le_bytes());
    header
}

/// Writes one framed record and returns the number of bytes written.
pub fn write_record<W: Write>(out: &mut W, payload: &[u8]) -> io::Result<u64> {
    out.write_all(&encode_header(payload.len() as u64))?;
    out.write_all(payload)?;
    out.write_all(&masked_crc32c(payload).to_le_bytes())?;
    Ok(payload.len() as u64 + FRAME_OVERHEAD)
}

/// A complete framed record in memory.
pub fn frame(payload: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(payload.len() + FRAME_OVERHEAD as usize);
    // Writing into a Vec cannot fail.
    let _ = write_record(&mut out, payload);
    out
}

/// Something that can be read at arbitrary byte offsets: a file or a buffer.
pub trait Source {
    /// Total size in bytes.
    fn size(&self) -> u64;
    /// Fills `buf` from `offset`; the caller guarantees the range is in bounds.
    fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()>;
    /// How the source changed since it was opened (a sentence), or `None`
    /// when it is as it was, so that what was read from it can be trusted.
    /// Sources that cannot change (buffers in memory) keep the default.
    fn changed(&self) -> io::Result<Option<String>> {
        Ok(None)
    }
}

/// A file read at the size it had when it was opened.
///
/// The file is read with positional reads (`pread`), never mapped, so a file
/// that shrinks under the reader gives a short read, not `SIGBUS`. Its size
/// and modification time are taken at open; [`Source::changed`] compares
/// them with what the file says now and looks for a link count of 0, so a
/// shard that is rewritten, truncated, deleted or replaced (renamed over)
/// after it was opened is reported instead of being read as if it were the
/// file the index describes. Not noticed: a rewrite that keeps the size
/// within the file system's timestamp tick of the open.
#[derive(Debug)]
pub struct SizedFile {
    file: File,
    opened: Stamp,
}

/// What [`SizedFile`] compares to notice that a file changed.
///
/// The change time is left out on purpose: `chmod`, `chown` or a new hard
/// link change it without touching the bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Stamp {
    size: u64,
    mtime: (i64, i64),
}

impl Stamp {
    fn of(meta: &Metadata) -> Self {
        Stamp {
            size: meta.len(),
            mtime: (meta.mtime(), meta.mtime_nsec()),
        }
    }
}

impl SizedFile {
    /// Opens `path` for positional reads.
    pub fn open(path: &Path) -> Result<Self> {
        let file = File::open(path).map_err(|e| Error::io(path, e))?;
        let meta = file.metadata().map_err(|e| Error::io(path, e))?;
        Ok(SizedFile {
            file,
            opened: Stamp::of(&meta),
        })
    }
}

impl Source for SizedFile {
    fn size(&self) -> u64 {
        self.opened.size
    }
    fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        FileExt::read_exact_at(&self.file, buf, offset)
    }
    fn changed(&self) -> io::Result<Option<String>> {
        // One fstat per record read (the reader calls this after reading).
        let meta = self.file.metadata()?;
        let now = Stamp::of(&meta);
        Ok(if meta.nlink() == 0 {
            Some("it was deleted, or replaced by another file".into())
        } else if now.size != self.opened.size {
            Some(format!(
                "its size went from {} to {} bytes",
                self.opened.size, now.size
            ))
        } else if now != self.opened {
            Some("it was rewritten: its modification time changed".into())
        } else {
            None
        })
    }
}

impl Source for [u8] {
    fn size(&self) -> u64 {
        self.len() as u64
    }
    fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        let start = usize::try_from(offset).map_err(|_| io::ErrorKind::UnexpectedEof)?;
        let src = start
            .checked_add(buf.len())
            .and_then(|end| self.get(start..end))
            .ok_or(io::ErrorKind::UnexpectedEof)?;
        buf.copy_from_slice(src);
        Ok(())
    }
}

impl Source for Vec<u8> {
    fn size(&self) -> u64 {
        self.as_slice().size()
    }
    fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        self.as_slice().read_exact_at(buf, offset)
    }
}

/// Random-access reader of one TFRecord file (a shard).
#[derive(Debug)]
pub struct RecordReader<S: Source + ?Sized> {
    path: PathBuf,
    verify: bool,
    source: S,
}

impl RecordReader<SizedFile> {
    /// Opens a shard. With `verify`, every read checks both CRCs.
    pub fn open(path: impl Into<PathBuf>, verify: bool) -> Result<Self> {
        let path = path.into();
        let source = SizedFile::open(&path)?;
        Ok(RecordReader {
            path,
            verify,
            source,
        })
    }
}

impl<S: Source> RecordReader<S> {
    /// Reads records from an arbitrary source; `path` is used in messages.
    pub fn from_source(source: S, path: impl Into<PathBuf>, verify: bool) -> Self {
        RecordReader {
            path: path.into(),
            verify,
            source,
        }
    }
}

impl<S: Source + ?Sized> RecordReader<S> {
    /// The path used in error messages.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Size of the underlying file in bytes.
    pub fn size(&self) -> u64 {
        self.source.size()
    }

    fn corrupt(&self, offset: u64, kind: Corruption) -> Error {
        Error::CorruptRecord {
            path: self.path.clone(),
            offset,
            kind,
        }
    }

    /// Reads `buf.len()` bytes at `at`, part of the record at `record`.
    fn read(&self, buf: &mut [u8], at: u64, record: u64) -> Result<()> {
        self.source.read_exact_at(buf, at).map_err(|e| {
            if e.kind() == io::ErrorKind::UnexpectedEof {
                // The bounds were checked against the size at open: the
                // file is shorter now.
                Error::FileChanged {
                    path: self.path.clone(),
                    offset: record,
                    change: format!(
                        "it ends before byte {} although it had {} bytes when opened",
                        at + buf.len() as u64,
                        self.source.size()
                    ),
                }
            } else {
                Error::io(&self.path, e)
            }
        })
    }

    /// `result`, the outcome of reading the record at `offset`, unless the
    /// source changed since it was opened: then neither the bytes read nor a
    /// framing error found in them can be trusted, and the error says so.
    fn unless_changed<T>(&self, offset: u64, result: Result<T>) -> Result<T> {
        match self.source.changed() {
            Ok(None) => result,
            Ok(Some(change)) => Err(Error::FileChanged {
                path: self.path.clone(),
                offset,
                change,
            }),
            Err(e) => Err(Error::io(&self.path, e)),
        }
    }

    /// Reads and checks the header at `offset`; returns the payload length.
    ///
    /// The length is checked against the file size here, before anyone
    /// allocates a buffer for it.
    pub fn read_header(&self, offset: u64) -> Result<u64> {
        let result = self.header(offset);
        self.unless_changed(offset, result)
    }

    fn header(&self, offset: u64) -> Result<u64> {
        let size = self.source.size();
        if offset >= size {
            return Err(self.corrupt(offset, Corruption::OffsetPastEnd { file_len: size }));
        }
        let available = size - offset;
        if available < HEADER_LEN {
            return Err(self.corrupt(offset, Corruption::TruncatedHeader { available }));
        }
        let mut header = [0u8; HEADER_LEN as usize];
        self.read(&mut header, offset, offset)?;
        let (len_bytes, crc_bytes) = header.split_at(8);
        let length = u64::from_le_bytes(len_bytes.try_into().expect("8 bytes"));
        if self.verify {
            let stored = u32::from_le_bytes(crc_bytes.try_into().expect("4 bytes"));
            let computed = masked_crc32c(len_bytes);
            if stored != computed {
                return Err(self.corrupt(offset, Corruption::LengthCrc { stored, computed }));
            }
        }
        let remaining = available - HEADER_LEN;
        if length
            .checked_add(FOOTER_LEN)
            .is_none_or(|need| need > remaining)
        {
            return Err(self.corrupt(
                offset,
                Corruption::LengthPastEnd {
                    length,
                    available: remaining,
                },
            ));
        }
        Ok(length)
    }

    /// Reads the payload of the record at `offset` into `buf` (replacing its
    /// contents) and returns the offset of the next record.
    ///
    /// A file that changed since it was opened fails with
    /// [`Error::FileChanged`] (checked after the read, so no bytes of a
    /// changed file are returned), even where its bytes still frame.
    pub fn read_into(&self, offset: u64, buf: &mut Vec<u8>) -> Result<u64> {
        let result = self.payload_into(offset, buf);
        let result = self.unless_changed(offset, result);
        if result.is_err() {
            buf.clear();
        }
        result
    }

    fn payload_into(&self, offset: u64, buf: &mut Vec<u8>) -> Result<u64> {
        let length = self.header(offset)?;
        // header() bounded length by the file size, so this fits in memory
        // as far as the file does.
        let total = usize::try_from(length + FOOTER_LEN).map_err(|_| {
            Error::InvalidArgument(format!(
                "{}: record at offset {offset} is too large for this platform",
                self.path.display()
            ))
        })?;
        // Reuse the buffer: bytes already there are overwritten by the read,
        // so only growth is zero-filled.
        buf.truncate(total);
        buf.resize(total, 0);
        self.read(buf, offset + HEADER_LEN, offset)?;
        let payload_len = total - FOOTER_LEN as usize;
        if self.verify {
            let stored = u32::from_le_bytes(buf[payload_len..].try_into().expect("4-byte footer"));
            let computed = masked_crc32c(&buf[..payload_len]);
            if stored != computed {
                return Err(self.corrupt(
                    offset,
                    Corruption::PayloadCrc {
                        length,
                        stored,
                        computed,
                    },
                ));
            }
        }
        buf.truncate(payload_len);
        Ok(offset + HEADER_LEN + length + FOOTER_LEN)
    }

    /// The payload of the record at `offset`.
    pub fn read_at(&self, offset: u64) -> Result<Vec<u8>> {
        let mut buf = Vec::new();
        self.read_into(offset, &mut buf)?;
        Ok(buf)
    }

    /// Iterates over `(offset, payload)` from the start of the file. The
    /// iterator yields the first error and then stops.
    pub fn scan(&self) -> Scan<'_, S> {
        self.scan_from(0)
    }

    /// Like [`scan`](Self::scan) but starting at `offset`.
    pub fn scan_from(&self, offset: u64) -> Scan<'_, S> {
        Scan {
            reader: self,
            offset,
            failed: false,
        }
    }
}

/// Sequential iterator over the records of a [`RecordReader`].
pub struct Scan<'a, S: Source + ?Sized> {
    reader: &'a RecordReader<S>,
    offset: u64,
    failed: bool,
}

impl<S: Source + ?Sized> Scan<'_, S> {
    /// Offset of the next record to be read.
    pub fn offset(&self) -> u64 {
        self.offset
    }

    /// Reads the next record into `buf`; `Ok(None)` at a clean end of file.
    pub fn next_into(&mut self, buf: &mut Vec<u8>) -> Result<Option<u64>> {
        if self.failed || self.offset == self.reader.size() {
            return Ok(None);
        }
        let at = self.offset;
        match self.reader.read_into(at, buf) {
            Ok(next) => {
                self.offset = next;
                Ok(Some(at))
            }
            Err(e) => {
                self.failed = true;
                Err(e)
            }
        }
    }
}

impl<S: Source + ?Sized> Iterator for Scan<'_, S> {
    type Item = Result<(u64, Vec<u8>)>;

    fn next(&mut self) -> Option<Self::Item> {
        let mut buf = Vec::new();
        match self.next_into(&mut buf) {
            Ok(Some(at)) => Some(Ok((at, buf))),
            Ok(None) => None,
            Err(e) => Some(Err(e)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shard(payloads: &[&[u8]]) -> Vec<u8> {
        payloads.iter().flat_map(|p| frame(p)).collect()
    }

    fn reader(bytes: Vec<u8>) -> RecordReader<Vec<u8>> {
        RecordReader::from_source(bytes, "mem.tfrecord", true)
    }

    #[test]
    fn header_layout_matches_tensorflow() {
        let framed = frame(b"hello");
        assert_eq!(framed.len(), 5 + 16);
        assert_eq!(&framed[..8], &5u64.to_le_bytes());
        assert_eq!(
            &framed[8..12],
            &masked_crc32c(&5u64.to_le_bytes()).to_le_bytes()
        );
        assert_eq!(&framed[12..17], b"hello");
        assert_eq!(&framed[17..], &masked_crc32c(b"hello").to_le_bytes());
    }

    #[test]
    fn scan_and_random_access_roundtrip() {
        let r = reader(shard(&[b"a", b"", b"ccc"]));
        let all: Vec<_> = r.scan().collect::<Result<_>>().unwrap();
        assert_eq!(
            all,
            vec![(0, b"a".to_vec()), (17, vec![]), (33, b"ccc".to_vec())]
        );
        assert_eq!(r.read_at(33).unwrap(), b"ccc");
        assert_eq!(r.read_at(17).unwrap(), b"");
    }

    #[test]
    fn empty_file_scans_to_nothing() {
        assert_eq!(reader(Vec::new()).scan().count(), 0);
    }

    fn kind(err: Error) -> (u64, Corruption) {
        match err {
            Error::CorruptRecord { offset, kind, .. } => (offset, kind),
            other => panic!("expected CorruptRecord, got {other:?}"),
        }
    }

    #[test]
    fn truncated_mid_payload() {
        let mut bytes = shard(&[b"first", b"second record"]);
        bytes.truncate(bytes.len() - 6);
        let r = reader(bytes);
        let mut scan = r.scan();
        assert!(scan.next().unwrap().is_ok());
        let (offset, k) = kind(scan.next().unwrap().unwrap_err());
        assert_eq!(offset, 21);
        assert_eq!(
            k,
            Corruption::LengthPastEnd {
                length: 13,
                available: 11
            }
        );
        assert!(scan.next().is_none(), "scan stops after the first error");
    }

    #[test]
    fn truncated_header() {
        let mut bytes = shard(&[b"x"]);
        bytes.extend_from_slice(&[1, 2, 3]);
        let (offset, k) = kind(reader(bytes).scan().nth(1).unwrap().unwrap_err());
        assert_eq!(
            (offset, k),
            (17, Corruption::TruncatedHeader { available: 3 })
        );
    }

    #[test]
    fn length_crc_mismatch() {
        let mut bytes = shard(&[b"abc"]);
        bytes[0] ^= 0x01;
        let (_, k) = kind(reader(bytes).read_at(0).unwrap_err());
        assert!(matches!(k, Corruption::LengthCrc { .. }), "{k:?}");
    }

    #[test]
    fn payload_crc_mismatch() {
        let mut bytes = shard(&[b"abc"]);
        bytes[13] ^= 0x80;
        let (offset, k) = kind(reader(bytes).read_at(0).unwrap_err());
        assert_eq!(offset, 0);
        assert!(
            matches!(k, Corruption::PayloadCrc { length: 3, .. }),
            "{k:?}"
        );
    }

    #[test]
    fn huge_length_is_rejected_before_allocation() {
        // A header that claims u64::MAX bytes, with a valid length CRC.
        let mut bytes = encode_header(u64::MAX).to_vec();
        bytes.extend_from_slice(b"tail");
        let (_, k) = kind(reader(bytes).read_at(0).unwrap_err());
        assert_eq!(
            k,
            Corruption::LengthPastEnd {
                length: u64::MAX,
                available: 4
            }
        );
    }

    #[test]
    fn unverified_reads_skip_crcs_but_still_bound_lengths() {
        let mut bytes = shard(&[b"abc"]);
        bytes[13] ^= 0x80;
        let r = RecordReader::from_source(bytes.clone(), "mem", false);
        assert_eq!(r.read_at(0).unwrap(), vec![b'a', b'b' ^ 0x80, b'c']);
        let mut huge = encode_header(1 << 40).to_vec();
        huge[8] ^= 1; // bad length CRC is not checked without verify
        assert!(RecordReader::from_source(huge, "mem", false)
            .read_at(0)
            .is_err());
    }

    fn on_disk(payloads: &[&[u8]]) -> (tempfile::TempDir, PathBuf) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.tfrecord");
        std::fs::write(&path, shard(payloads)).unwrap();
        (dir, path)
    }

    fn change(err: Error) -> (u64, String) {
        match err {
            Error::FileChanged { offset, change, .. } => (offset, change),
            other => panic!("expected FileChanged, got {other:?}"),
        }
    }

    #[test]
    fn file_truncated_after_open_names_the_offset() {
        let (_dir, path) = on_disk(&[b"first", b"second record"]);
        let r = RecordReader::open(&path, true).unwrap();
        let f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
        f.set_len(30).unwrap();
        // Both the record cut short and the intact one before it: the file
        // is no longer the one that was opened.
        let (offset, what) = change(r.read_at(21).unwrap_err());
        assert_eq!(offset, 21);
        assert!(what.contains("from 50 to 30 bytes"), "{what}");
        assert_eq!(change(r.read_at(0).unwrap_err()).0, 0);
        let msg = r.read_at(21).unwrap_err().to_string();
        assert!(
            msg.contains("s.tfrecord") && msg.contains("offset 21"),
            "{msg}"
        );
    }

    #[test]
    fn short_read_is_a_change_even_when_the_stamp_matches() {
        // A source whose size claims more than it holds, as a file that
        // shrank and grew back within one timestamp tick would look.
        struct Liar(Vec<u8>);
        impl Source for Liar {
            fn size(&self) -> u64 {
                self.0.len() as u64 + 100
            }
            fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
                self.0.read_exact_at(buf, offset)
            }
        }
        let mut bytes = encode_header(90).to_vec();
        bytes.extend_from_slice(b"short");
        let r = RecordReader::from_source(Liar(bytes), "liar", true);
        let (offset, what) = change(r.read_at(0).unwrap_err());
        assert_eq!(offset, 0);
        assert!(what.contains("ends before byte 106"), "{what}");
    }

    #[test]
    fn file_rewritten_deleted_or_replaced_after_open_is_refused() {
        // Rewritten in place with records that frame at the same offsets:
        // the CRCs pass, only the file's stamp tells.
        let (_dir, path) = on_disk(&[b"aaaa", b"bbbb"]);
        let r = RecordReader::open(&path, true).unwrap();
        assert_eq!(r.read_at(20).unwrap(), b"bbbb");
        let mut f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
        let later = std::time::SystemTime::now() + std::time::Duration::from_secs(5);
        f.write_all(&shard(&[b"AAAA", b"BBBB"])).unwrap();
        f.set_modified(later).unwrap();
        let (offset, what) = change(r.read_at(20).unwrap_err());
        assert_eq!(offset, 20);
        assert!(what.contains("rewritten"), "{what}");

        let (_dir, path) = on_disk(&[b"aaaa"]);
        let r = RecordReader::open(&path, true).unwrap();
        std::fs::remove_file(&path).unwrap();
        assert!(change(r.read_at(0).unwrap_err()).1.contains("deleted"));

        let (dir, path) = on_disk(&[b"aaaa"]);
        let r = RecordReader::open(&path, true).unwrap();
        let other = dir.path().join("new.tfrecord");
        std::fs::write(&other, shard(&[b"zzzz"])).unwrap();
        std::fs::rename(&other, &path).unwrap();
        let mut buf = b"dirty".to_vec();
        let err = r.read_into(0, &mut buf).unwrap_err();
        assert!(change(err).1.contains("replaced"));
        assert!(buf.is_empty(), "no bytes of a changed file are handed out");
        // A new reader reads the new file.
        assert_eq!(
            RecordReader::open(&path, true).unwrap().read_at(0).unwrap(),
            b"zzzz"
        );
    }

    #[test]
    fn unchanged_file_reads_and_chmod_is_not_a_change() {
        use std::os::unix::fs::PermissionsExt;
        let (_dir, path) = on_disk(&[b"aaaa", b"bbbb"]);
        let r = RecordReader::open(&path, true).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o444)).unwrap();
        let all: Vec<_> = r.scan().collect::<Result<_>>().unwrap();
        assert_eq!(all, vec![(0, b"aaaa".to_vec()), (20, b"bbbb".to_vec())]);
        assert_eq!(r.read_header(20).unwrap(), 4);
    }

    #[test]
    fn offset_past_end() {
        let (_, k) = kind(reader(shard(&[b"a"])).read_at(100).unwrap_err());
        assert_eq!(k, Corruption::OffsetPastEnd { file_len: 17 });
    }
}
