//! Record framing: encoding, and positional reading with CRC verification.

use std::fs::File;
use std::io::{self, Write};
use std::os::unix::fs::FileExt;
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
}

/// A file whose size is taken once, when it is opened.
#[derive(Debug)]
pub struct SizedFile {
    file: File,
    size: u64,
}

impl SizedFile {
    /// Opens `path` for positional reads.
    pub fn open(path: &Path) -> Result<Self> {
        let file = File::open(path).map_err(|e| Error::io(path, e))?;
        let size = file.metadata().map_err(|e| Error::io(path, e))?.len();
        Ok(SizedFile { file, size })
    }
}

impl Source for SizedFile {
    fn size(&self) -> u64 {
        self.size
    }
    fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        FileExt::read_exact_at(&self.file, buf, offset)
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

    fn read(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        self.source
            .read_exact_at(buf, offset)
            .map_err(|e| Error::io(&self.path, e))
    }

    /// Reads and checks the header at `offset`; returns the payload length.
    ///
    /// The length is checked against the file size here, before anyone
    /// allocates a buffer for it.
    pub fn read_header(&self, offset: u64) -> Result<u64> {
        let size = self.source.size();
        if offset >= size {
            return Err(self.corrupt(offset, Corruption::OffsetPastEnd { file_len: size }));
        }
        let available = size - offset;
        if available < HEADER_LEN {
            return Err(self.corrupt(offset, Corruption::TruncatedHeader { available }));
        }
        let mut header = [0u8; HEADER_LEN as usize];
        self.read(&mut header, offset)?;
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
    pub fn read_into(&self, offset: u64, buf: &mut Vec<u8>) -> Result<u64> {
        let length = self.read_header(offset)?;
        // read_header bounded length by the file size, so this fits in memory
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
        self.read(buf, offset + HEADER_LEN)?;
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

    #[test]
    fn offset_past_end() {
        let (_, k) = kind(reader(shard(&[b"a"])).read_at(100).unwrap_err());
        assert_eq!(k, Corruption::OffsetPastEnd { file_len: 17 });
    }
}
