//! The zip archive `torch.save` writes (PyTorch 1.6 and later), read by
//! hand from the mapped file: the end-of-central-directory record (its
//! zip64 form when the archive passes 4 GiB or 65535 records), the central
//! directory, and each record's local header, which says where its bytes
//! start. Nothing is decompressed: torch stores every record as is (STORED,
//! storages aligned to 64 bytes), so a record is a window of the mapping. A
//! compressed or encrypted record is refused when it is needed.

use std::path::Path;

use crate::Error;

const EOCD_SIG: u32 = 0x0605_4b50;
const EOCD_LEN: usize = 22;
const ZIP64_LOCATOR_SIG: u32 = 0x0706_4b50;
const ZIP64_LOCATOR_LEN: usize = 20;
const ZIP64_EOCD_SIG: u32 = 0x0606_4b50;
const ZIP64_EOCD_LEN: usize = 56;
const CENTRAL_SIG: u32 = 0x0201_4b50;
const CENTRAL_LEN: usize = 46;
const LOCAL_SIG: u32 = 0x0403_4b50;
const LOCAL_LEN: usize = 30;
const ZIP64_EXTRA_ID: u16 = 0x0001;
/// The longest archive comment, so the farthest the end record can be
/// from the end of the file.
const MAX_COMMENT: usize = 0xffff;

/// One record of the archive, located but not read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Record {
    /// Name as stored (`archive/data/0`).
    pub name: String,
    /// Compression method (0 is STORED).
    method: u16,
    /// General-purpose flags (bit 0: encrypted).
    flags: u16,
    /// Offset of the record's bytes in the file.
    pub start: usize,
    /// Bytes stored (equal to the uncompressed size for a STORED record).
    pub len: usize,
}

impl Record {
    /// The record's bytes, refused when they are not stored as is.
    pub fn stored<'a>(&self, path: &Path, file: &'a [u8]) -> Result<&'a [u8], Error> {
        if self.flags & 1 != 0 {
            return Err(Error::torch(
                path,
                Some(&self.name),
                "is encrypted; torch.save never encrypts, so the archive was re-packed: re-save it with torch.save",
            ));
        }
        if self.method != 0 {
            let method = match self.method {
                8 => " (deflate)".to_string(),
                12 => " (bzip2)".to_string(),
                14 => " (lzma)".to_string(),
                93 => " (zstd)".to_string(),
                _ => String::new(),
            };
            return Err(Error::torch(
                path,
                Some(&self.name),
                format!(
                    "is compressed with method {}{method}; torch.save stores records uncompressed, so the archive was re-packed: re-save it with torch.save (or `zip -0`)",
                    self.method
                ),
            ));
        }
        // Bounds were checked when the record was located.
        Ok(&file[self.start..self.start + self.len])
    }
}

/// Little-endian fields at fixed offsets of a byte slice.
struct Fields<'a>(&'a [u8]);

impl Fields<'_> {
    fn u16(&self, at: usize) -> u16 {
        u16::from_le_bytes([self.0[at], self.0[at + 1]])
    }
    fn u32(&self, at: usize) -> u32 {
        u32::from_le_bytes(self.0[at..at + 4].try_into().unwrap())
    }
    fn u64(&self, at: usize) -> u64 {
        u64::from_le_bytes(self.0[at..at + 8].try_into().unwrap())
    }
}

/// `len` bytes of `file` at `offset`, or `None` when they run past its end.
fn window(file: &[u8], offset: u64, len: usize) -> Option<&[u8]> {
    let start = usize::try_from(offset).ok()?;
    file.get(start..start.checked_add(len)?)
}

/// Where the central directory is and how many records it holds.
struct Directory {
    offset: u64,
    size: u64,
    records: u64,
}

/// Lists the records of the zip archive `file` (`path` names it in
/// errors). Reads the end records, the central directory and one local
/// header per record; checks that every record lies inside the file.
pub(crate) fn records(path: &Path, file: &[u8]) -> Result<Vec<Record>, Error> {
    let fail = |problem: String| Error::torch(path, None, problem);
    let dir = directory(path, file)?;
    let cd = window(file, dir.offset, usize::try_from(dir.size).unwrap_or(usize::MAX))
        .ok_or_else(|| {
            fail(format!(
                "the central directory ({} bytes at offset {}) runs past the end of the file ({} bytes; truncated?)",
                dir.size,
                dir.offset,
                file.len()
            ))
        })?;
    // Every entry takes at least CENTRAL_LEN bytes, which bounds the
    // allocation whatever count the end record declares.
    let mut records = Vec::with_capacity((cd.len() / CENTRAL_LEN).min(dir.records as usize));
    let mut at = 0usize;
    for n in 0..dir.records {
        let entry = cd
            .get(at..at + CENTRAL_LEN)
            .filter(|e| Fields(e).u32(0) == CENTRAL_SIG)
            .ok_or_else(|| {
                fail(format!(
                    "central directory entry {n} of {} is missing or damaged (at offset {})",
                    dir.records,
                    dir.offset + at as u64
                ))
            })?;
        let f = Fields(entry);
        let (name_len, extra_len, comment_len) =
            (f.u16(28) as usize, f.u16(30) as usize, f.u16(32) as usize);
        let variable = cd
            .get(at + CENTRAL_LEN..at + CENTRAL_LEN + name_len + extra_len + comment_len)
            .ok_or_else(|| {
                fail(format!(
                    "central directory entry {n} runs past the directory's end"
                ))
            })?;
        let name = std::str::from_utf8(&variable[..name_len])
            .map_err(|_| fail(format!("record name of entry {n} is not UTF-8")))?
            .to_string();
        let extra = &variable[name_len..name_len + extra_len];
        let mut compressed = u64::from(f.u32(20));
        let mut size = u64::from(f.u32(24));
        let mut local = u64::from(f.u32(42));
        if f.u16(34) != 0 && f.u16(34) != 0xffff {
            return Err(Error::torch(
                path,
                Some(&name),
                "is on another disk of a multi-part archive",
            ));
        }
        zip64_fields(extra, &mut [&mut size, &mut compressed, &mut local]).ok_or_else(|| {
            Error::torch(
                path,
                Some(&name),
                "has a damaged zip64 extra field in the central directory",
            )
        })?;
        let start = data_start(path, file, &name, local)?;
        let len = usize::try_from(compressed)
            .ok()
            .filter(|&len| start.checked_add(len).is_some_and(|end| end <= file.len()));
        let Some(len) = len else {
            return Err(Error::torch(
                path,
                Some(&name),
                format!(
                    "its {compressed} bytes at offset {start} run past the end of the file ({} bytes; truncated?)",
                    file.len()
                ),
            ));
        };
        let method = f.u16(10);
        if method == 0 && compressed != size {
            return Err(Error::torch(
                path,
                Some(&name),
                format!("is stored uncompressed but declares {compressed} stored bytes for {size}"),
            ));
        }
        records.push(Record {
            name,
            method,
            flags: f.u16(8),
            start,
            len,
        });
        at += CENTRAL_LEN + variable.len();
    }
    Ok(records)
}

/// Finds the end-of-central-directory record, following the zip64 locator
/// when a field of the classic record is saturated.
fn directory(path: &Path, file: &[u8]) -> Result<Directory, Error> {
    let not_zip = || {
        Error::torch(
            path,
            None,
            format!(
                "no zip end-of-central-directory record in its last {} bytes: not a torch.save archive, or truncated",
                file.len().min(EOCD_LEN + MAX_COMMENT)
            ),
        )
    };
    let last = file.len().checked_sub(EOCD_LEN).ok_or_else(not_zip)?;
    let first = last.saturating_sub(MAX_COMMENT);
    // The record whose comment ends exactly at the end of the file.
    let eocd = (first..=last)
        .rev()
        .find(|&at| {
            let f = Fields(&file[at..]);
            f.u32(0) == EOCD_SIG && at + EOCD_LEN + f.u16(20) as usize == file.len()
        })
        .ok_or_else(not_zip)?;
    let f = Fields(&file[eocd..]);
    let classic = Directory {
        records: u64::from(f.u16(10)),
        size: u64::from(f.u32(12)),
        offset: u64::from(f.u32(16)),
    };
    if f.u16(4) != 0 && f.u16(4) != 0xffff {
        return Err(Error::torch(
            path,
            None,
            "is one part of a multi-part zip archive",
        ));
    }
    let saturated =
        classic.records == 0xffff || classic.size == 0xffff_ffff || classic.offset == 0xffff_ffff;
    let locator = eocd
        .checked_sub(ZIP64_LOCATOR_LEN)
        .map(|at| &file[at..eocd])
        .filter(|l| Fields(l).u32(0) == ZIP64_LOCATOR_SIG);
    let Some(locator) = locator else {
        return if saturated {
            Err(Error::torch(
                path,
                None,
                "the end record needs a zip64 record, and there is none (truncated or damaged archive)",
            ))
        } else {
            Ok(classic)
        };
    };
    let at = Fields(locator).u64(8);
    let record = window(file, at, ZIP64_EOCD_LEN)
        .filter(|r| Fields(r).u32(0) == ZIP64_EOCD_SIG)
        .ok_or_else(|| {
            Error::torch(
                path,
                None,
                format!("no zip64 end record at offset {at}, where its locator points"),
            )
        })?;
    let f = Fields(record);
    Ok(Directory {
        records: f.u64(32),
        size: f.u64(40),
        offset: f.u64(48),
    })
}

/// Replaces the saturated (all-ones) fields, in zip order, with the 64-bit
/// values of the zip64 extra field. `None` when the field is needed and
/// missing or short.
fn zip64_fields(extra: &[u8], fields: &mut [&mut u64; 3]) -> Option<()> {
    let needed = fields.iter().filter(|f| ***f == 0xffff_ffff).count();
    if needed == 0 {
        return Some(());
    }
    let mut at = 0;
    while at + 4 <= extra.len() {
        let f = Fields(&extra[at..]);
        let (id, len) = (f.u16(0), f.u16(2) as usize);
        let body = extra.get(at + 4..at + 4 + len)?;
        if id == ZIP64_EXTRA_ID {
            let mut values = body.chunks_exact(8).map(|c| Fields(c).u64(0));
            for field in fields.iter_mut().filter(|f| ***f == 0xffff_ffff) {
                **field = values.next()?;
            }
            return Some(());
        }
        at += 4 + len;
    }
    None
}

/// Offset of a record's bytes: after its local header, whose name and
/// extra field may differ in length from the central directory's.
fn data_start(path: &Path, file: &[u8], name: &str, local: u64) -> Result<usize, Error> {
    let header = window(file, local, LOCAL_LEN)
        .filter(|h| Fields(h).u32(0) == LOCAL_SIG)
        .ok_or_else(|| {
            Error::torch(
                path,
                Some(name),
                format!("no local header at offset {local} (truncated or damaged archive)"),
            )
        })?;
    let f = Fields(header);
    // `local` fits in usize: `window` found the header.
    Ok(local as usize + LOCAL_LEN + f.u16(26) as usize + f.u16(28) as usize)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A zip archive of STORED records, written here so that tests control
    /// every field (`zip64` puts sizes and offsets in zip64 records, as an
    /// archive over 4 GiB has them).
    pub(crate) fn build(records: &[(&str, &[u8])], zip64: bool) -> Vec<u8> {
        let mut out = Vec::new();
        let mut central = Vec::new();
        for (name, data) in records {
            let local = out.len() as u64;
            out.extend_from_slice(&LOCAL_SIG.to_le_bytes());
            out.extend_from_slice(&[20, 0, 0, 0, 0, 0, 0, 0, 0, 0]); // version, flags, method, time, date
            out.extend_from_slice(&0u32.to_le_bytes()); // crc (not checked)
            out.extend_from_slice(&(data.len() as u32).to_le_bytes());
            out.extend_from_slice(&(data.len() as u32).to_le_bytes());
            out.extend_from_slice(&(name.len() as u16).to_le_bytes());
            out.extend_from_slice(&0u16.to_le_bytes());
            out.extend_from_slice(name.as_bytes());
            out.extend_from_slice(data);

            let (size, offset, extra) = if zip64 {
                let mut extra = ZIP64_EXTRA_ID.to_le_bytes().to_vec();
                extra.extend_from_slice(&24u16.to_le_bytes());
                for v in [data.len() as u64, data.len() as u64, local] {
                    extra.extend_from_slice(&v.to_le_bytes());
                }
                (0xffff_ffff, 0xffff_ffff, extra)
            } else {
                (data.len() as u32, local as u32, Vec::new())
            };
            central.extend_from_slice(&CENTRAL_SIG.to_le_bytes());
            central.extend_from_slice(&[45, 0, 45, 0, 0, 0, 0, 0, 0, 0, 0, 0]);
            central.extend_from_slice(&0u32.to_le_bytes());
            central.extend_from_slice(&size.to_le_bytes());
            central.extend_from_slice(&size.to_le_bytes());
            central.extend_from_slice(&(name.len() as u16).to_le_bytes());
            central.extend_from_slice(&(extra.len() as u16).to_le_bytes());
            central.extend_from_slice(&[0; 10]); // comment len, disk, attributes
            central.extend_from_slice(&offset.to_le_bytes());
            central.extend_from_slice(name.as_bytes());
            central.extend_from_slice(&extra);
        }
        let cd_offset = out.len() as u64;
        out.extend_from_slice(&central);
        let n = records.len() as u64;
        if zip64 {
            let at = out.len() as u64;
            out.extend_from_slice(&ZIP64_EOCD_SIG.to_le_bytes());
            out.extend_from_slice(&44u64.to_le_bytes());
            out.extend_from_slice(&[45, 0, 45, 0, 0, 0, 0, 0, 0, 0, 0, 0]);
            for v in [n, n, central.len() as u64, cd_offset] {
                out.extend_from_slice(&v.to_le_bytes());
            }
            out.extend_from_slice(&ZIP64_LOCATOR_SIG.to_le_bytes());
            out.extend_from_slice(&0u32.to_le_bytes());
            out.extend_from_slice(&at.to_le_bytes());
            out.extend_from_slice(&1u32.to_le_bytes());
        }
        out.extend_from_slice(&EOCD_SIG.to_le_bytes());
        out.extend_from_slice(&[0; 4]);
        let (count, size, offset) = if zip64 {
            (0xffff, 0xffff_ffff, 0xffff_ffff)
        } else {
            (n as u16, central.len() as u32, cd_offset as u32)
        };
        out.extend_from_slice(&count.to_le_bytes());
        out.extend_from_slice(&count.to_le_bytes());
        out.extend_from_slice(&size.to_le_bytes());
        out.extend_from_slice(&offset.to_le_bytes());
        out.extend_from_slice(&0u16.to_le_bytes());
        out
    }

    fn names_and_bytes(file: &[u8]) -> Vec<(String, Vec<u8>)> {
        let path = Path::new("t.bin");
        records(path, file)
            .unwrap()
            .iter()
            .map(|r| (r.name.clone(), r.stored(path, file).unwrap().to_vec()))
            .collect()
    }

    #[test]
    fn reads_classic_and_zip64_archives() {
        let recs: [(&str, &[u8]); 2] = [("a/data.pkl", b"pickle"), ("a/data/0", &[1, 2, 3, 4])];
        let expected: Vec<(String, Vec<u8>)> = recs
            .iter()
            .map(|(n, d)| (n.to_string(), d.to_vec()))
            .collect();
        assert_eq!(names_and_bytes(&build(&recs, false)), expected);
        assert_eq!(names_and_bytes(&build(&recs, true)), expected);
    }

    #[test]
    fn every_truncation_is_an_error() {
        let recs: [(&str, &[u8]); 2] = [("a/data.pkl", b"pickle"), ("a/data/0", &[9; 100])];
        for zip64 in [false, true] {
            let file = build(&recs, zip64);
            for cut in 0..file.len() {
                let err = records(Path::new("t.bin"), &file[..cut]).unwrap_err();
                assert!(err.to_string().starts_with("t.bin: "), "{err}");
            }
        }
    }

    #[test]
    fn damaged_fields_are_errors_naming_the_record() {
        let recs: [(&str, &[u8]); 1] = [("a/data/0", &[9; 16])];
        let file = build(&recs, false);
        let cd = file.len() - EOCD_LEN - (CENTRAL_LEN + "a/data/0".len());
        let err_with = |patch: &dyn Fn(&mut Vec<u8>)| {
            let mut f = file.clone();
            patch(&mut f);
            match records(Path::new("t.bin"), &f) {
                Ok(r) => r[0].stored(Path::new("t.bin"), &f).unwrap_err().to_string(),
                Err(e) => e.to_string(),
            }
        };
        // A declared size far past the end of the file.
        let e = err_with(&|f| {
            f[cd + 20..cd + 28].copy_from_slice(&[0xfe, 0xff, 0xff, 0x7f, 0xfe, 0xff, 0xff, 0x7f])
        });
        assert!(
            e.contains("record a/data/0") && e.contains("past the end"),
            "{e}"
        );
        // Deflate.
        let e = err_with(&|f| f[cd + 10] = 8);
        assert!(
            e.contains("record a/data/0: is compressed with method 8 (deflate)"),
            "{e}"
        );
        // Encrypted.
        let e = err_with(&|f| f[cd + 8] = 1);
        assert!(e.contains("is encrypted"), "{e}");
        // Local header offset pointing nowhere.
        let e = err_with(&|f| f[cd + 42] = 3);
        assert!(e.contains("no local header at offset 3"), "{e}");
        // A record count larger than the directory.
        let eocd = file.len() - EOCD_LEN;
        let e = err_with(&|f| f[eocd + 10..eocd + 12].copy_from_slice(&[0xfe, 0xff]));
        assert!(e.contains("entry 1 of 65534 is missing"), "{e}");
        // Saturated fields with no zip64 record.
        let e = err_with(&|f| f[eocd + 16..eocd + 20].copy_from_slice(&[0xff; 4]));
        assert!(e.contains("needs a zip64 record"), "{e}");
    }

    #[test]
    fn not_a_zip_is_named() {
        let e = records(Path::new("t.bin"), b"\x80\x02}q\x00.")
            .unwrap_err()
            .to_string();
        assert!(e.contains("not a torch.save archive"), "{e}");
    }
}
