//! Small reads of a rank file served from a few cached blocks. Opening a checkpoint reads each
//! chunk's `torch.save` framing — a handful of headers before and after its data — and chunks
//! sit next to each other, so one 8 KiB read answers the reads of many headers (about seven
//! `pread`s per chunk otherwise).

use std::cell::RefCell;
use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;

use crate::torch_save::ReadAt;

/// Bytes of a cached block.
const BLOCK: u64 = 8 << 10;
/// Blocks kept: the one before a chunk's data, the one after it, and the next chunk's.
const BLOCKS: usize = 4;
/// Reads at least this long go straight to the file.
const DIRECT: usize = 4 << 10;

/// A file read through a small cache of blocks (least recently used replaced).
pub struct BlockReader<'a> {
    file: &'a File,
    /// `(block start, bytes)`; the bytes are short at the end of the file.
    blocks: RefCell<Vec<(u64, Vec<u8>)>>,
}

impl<'a> BlockReader<'a> {
    pub fn new(file: &'a File) -> BlockReader<'a> {
        BlockReader { file, blocks: RefCell::new(Vec::new()) }
    }

    fn load(&self, start: u64) -> io::Result<Vec<u8>> {
        let mut buf = vec![0u8; BLOCK as usize];
        let mut got = 0;
        while got < buf.len() {
            match self.file.read_at(&mut buf[got..], start + got as u64) {
                Ok(0) => break,
                Ok(n) => got += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        buf.truncate(got);
        Ok(buf)
    }
}

impl ReadAt for BlockReader<'_> {
    fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        let start = offset / BLOCK * BLOCK;
        let end = offset.checked_add(buf.len() as u64).ok_or_else(|| io::Error::from(io::ErrorKind::InvalidInput))?;
        if buf.len() >= DIRECT || end > start + BLOCK {
            return FileExt::read_exact_at(self.file, buf, offset);
        }
        let mut blocks = self.blocks.borrow_mut();
        let hit = blocks.iter().position(|(s, _)| *s == start);
        let index = match hit {
            Some(i) => i,
            None => {
                if blocks.len() == BLOCKS {
                    blocks.remove(0);
                }
                blocks.push((start, self.load(start)?));
                blocks.len() - 1
            }
        };
        // Most recently used last.
        let block = blocks.remove(index);
        let at = (offset - start) as usize;
        let result = match block.1.get(at..at + buf.len()) {
            Some(src) => {
                buf.copy_from_slice(src);
                Ok(())
            }
            None => Err(io::Error::from(io::ErrorKind::UnexpectedEof)),
        };
        blocks.push(block);
        result
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    #[test]
    fn reads_match_the_file_and_stop_at_its_end() {
        let mut f = tempfile::tempfile().unwrap();
        let data: Vec<u8> = (0..200_000u32).map(|i| (i * 7 % 251) as u8).collect();
        f.write_all(&data).unwrap();
        let r = BlockReader::new(&f);
        for (off, len) in [(0u64, 10usize), (8_190, 12), (131_000, 100), (199_990, 10), (5, 20_000), (70_000, 3)] {
            let mut buf = vec![0u8; len];
            r.read_exact_at(&mut buf, off).unwrap();
            assert_eq!(buf, &data[off as usize..off as usize + len], "{off}+{len}");
        }
        let mut buf = vec![0u8; 20];
        assert_eq!(r.read_exact_at(&mut buf, 199_990).unwrap_err().kind(), io::ErrorKind::UnexpectedEof);
    }
}
