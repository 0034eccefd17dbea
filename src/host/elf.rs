//! What a shared object needs from the loader: its `NEEDED` libraries and the symbol versions it
//! asks of each (`.gnu.version_r`), read from the file's section headers.
//!
//! `tllm-affinity cdi` checks the library before it hands it to every container of a node: a
//! preloaded library that needs a library an image lacks, or a newer glibc than the image's,
//! stops every program of that image from starting. Reading the file here, rather than running
//! `readelf`, keeps the check on nodes that have no binutils.

use std::collections::BTreeSet;

/// The dynamic dependencies of one ELF file.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Needs {
    /// `DT_NEEDED` entries, in file order.
    pub libraries: Vec<String>,
    /// Every version name required (`GLIBC_2.17`, `GCC_3.0`, ...).
    pub versions: BTreeSet<String>,
}

/// The libraries of glibc itself: an image with glibc has them all.
pub const GLIBC_LIBRARIES: &[&str] = &[
    "libc.so.6",
    "libm.so.6",
    "libdl.so.2",
    "libpthread.so.0",
    "librt.so.1",
    "ld-linux-x86-64.so.2",
    "ld-linux-aarch64.so.1",
];

impl Needs {
    /// `NEEDED` entries that are not part of glibc.
    pub fn beyond_glibc(&self) -> Vec<&str> {
        self.libraries
            .iter()
            .map(String::as_str)
            .filter(|l| !GLIBC_LIBRARIES.contains(l))
            .collect()
    }

    /// The newest `GLIBC_x.y[.z]` version required, as numbers; `None` when none is.
    pub fn newest_glibc(&self) -> Option<Vec<u32>> {
        self.versions
            .iter()
            .filter_map(|v| v.strip_prefix("GLIBC_"))
            .filter_map(|v| v.split('.').map(|n| n.parse().ok()).collect())
            .max()
    }
}

/// Reads a 64-bit little-endian ELF file's dependencies.
pub fn read_needs(bytes: &[u8]) -> Result<Needs, String> {
    if bytes.len() < 64 || &bytes[..4] != b"\x7fELF" {
        return Err("not an ELF file".into());
    }
    if bytes[4] != 2 || bytes[5] != 1 {
        return Err("not a 64-bit little-endian ELF file".into());
    }
    let shoff = u64_at(bytes, 0x28)? as usize;
    let shentsize = u16_at(bytes, 0x3a)? as usize;
    let shnum = u16_at(bytes, 0x3c)? as usize;
    let sections: Vec<Section> = (0..shnum)
        .map(|i| Section::at(bytes, shoff + i * shentsize))
        .collect::<Result<_, _>>()?;
    let strings = |link: u32| -> Result<&[u8], String> {
        let s = sections
            .get(link as usize)
            .ok_or("a section links to no section")?;
        slice(bytes, s.offset, s.size)
    };
    let mut needs = Needs::default();
    for s in &sections {
        match s.kind {
            SHT_DYNAMIC => {
                let names = strings(s.link)?;
                let table = slice(bytes, s.offset, s.size)?;
                for entry in table.chunks_exact(16) {
                    let tag = u64_at(entry, 0)?;
                    if tag == DT_NEEDED {
                        needs
                            .libraries
                            .push(c_string(names, u64_at(entry, 8)? as usize)?);
                    }
                }
            }
            SHT_GNU_VERNEED => {
                let names = strings(s.link)?;
                let table = slice(bytes, s.offset, s.size)?;
                let mut at = 0usize;
                // Elf64_Verneed: version u16, count u16, file u32, aux u32, next u32.
                for _ in 0..s.info {
                    let count = u16_at(table, at + 2)? as usize;
                    let mut aux = at + u32_at(table, at + 8)? as usize;
                    // Elf64_Vernaux: hash u32, flags u16, other u16, name u32, next u32.
                    for _ in 0..count {
                        let name = u32_at(table, aux + 8)? as usize;
                        needs.versions.insert(c_string(names, name)?);
                        aux += u32_at(table, aux + 12)? as usize;
                    }
                    let next = u32_at(table, at + 12)? as usize;
                    if next == 0 {
                        break;
                    }
                    at += next;
                }
            }
            _ => {}
        }
    }
    Ok(needs)
}

const SHT_DYNAMIC: u32 = 6;
const SHT_GNU_VERNEED: u32 = 0x6fff_fffe;
const DT_NEEDED: u64 = 1;

struct Section {
    kind: u32,
    offset: usize,
    size: usize,
    link: u32,
    info: u32,
}

impl Section {
    /// Elf64_Shdr: name u32, type u32, flags u64, addr u64, offset u64, size u64, link u32,
    /// info u32, align u64, entsize u64.
    fn at(bytes: &[u8], at: usize) -> Result<Section, String> {
        Ok(Section {
            kind: u32_at(bytes, at + 4)?,
            offset: u64_at(bytes, at + 0x18)? as usize,
            size: u64_at(bytes, at + 0x20)? as usize,
            link: u32_at(bytes, at + 0x28)?,
            info: u32_at(bytes, at + 0x2c)?,
        })
    }
}

fn slice(bytes: &[u8], at: usize, len: usize) -> Result<&[u8], String> {
    at.checked_add(len)
        .and_then(|end| bytes.get(at..end))
        .ok_or_else(|| "the file is cut short".to_string())
}

fn u16_at(bytes: &[u8], at: usize) -> Result<u16, String> {
    Ok(u16::from_le_bytes(
        slice(bytes, at, 2)?.try_into().unwrap_or([0; 2]),
    ))
}

fn u32_at(bytes: &[u8], at: usize) -> Result<u32, String> {
    Ok(u32::from_le_bytes(
        slice(bytes, at, 4)?.try_into().unwrap_or([0; 4]),
    ))
}

fn u64_at(bytes: &[u8], at: usize) -> Result<u64, String> {
    Ok(u64::from_le_bytes(
        slice(bytes, at, 8)?.try_into().unwrap_or([0; 8]),
    ))
}

fn c_string(table: &[u8], at: usize) -> Result<String, String> {
    let rest = table.get(at..).ok_or("a name outside its string table")?;
    let end = rest.iter().position(|&b| b == 0).unwrap_or(rest.len());
    Ok(String::from_utf8_lossy(&rest[..end]).into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// This test binary itself: built by the host's toolchain, it needs libc at some GLIBC_ version.
    #[test]
    fn reads_the_needs_of_a_real_executable() {
        let bytes = std::fs::read(std::env::current_exe().unwrap()).unwrap();
        let needs = read_needs(&bytes).unwrap();
        assert!(
            needs.libraries.iter().any(|l| l == "libc.so.6"),
            "{needs:?}"
        );
        assert!(needs.newest_glibc().unwrap() >= vec![2, 2, 5], "{needs:?}");
    }

    #[test]
    fn refuses_what_is_not_elf_and_cut_files() {
        assert!(read_needs(b"#!/bin/sh\n").is_err());
        let bytes = std::fs::read(std::env::current_exe().unwrap()).unwrap();
        assert!(read_needs(&bytes[..4096]).is_err());
    }

    #[test]
    fn glibc_versions_compare_as_numbers() {
        let needs = Needs {
            libraries: vec!["libc.so.6".into(), "libgcc_s.so.1".into()],
            versions: ["GLIBC_2.9", "GLIBC_2.17", "GLIBC_2.2.5", "GCC_4.2.0"]
                .map(String::from)
                .into(),
        };
        assert_eq!(needs.newest_glibc(), Some(vec![2, 17]));
        assert_eq!(needs.beyond_glibc(), vec!["libgcc_s.so.1"]);
    }
}
