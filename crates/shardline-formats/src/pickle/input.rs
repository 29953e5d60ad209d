//! The byte stream a pickle is read from, with its position for error offsets.

use std::io::BufRead;

use super::PickleError;

/// Longest text line (`GLOBAL` names, text opcodes) the reader accepts.
pub(super) const MAX_LINE: usize = 64 << 10;

// ------------------------------------------------------------------------------------------------
// Input

/// A byte stream with its position, for error offsets.
pub(super) struct Input<R> {
    pub(super) r: R,
    pub(super) pos: u64,
}

impl<R: BufRead> Input<R> {
    pub(super) fn io(pos: u64) -> impl Fn(std::io::Error) -> PickleError {
        move |e| PickleError::Io { offset: pos, detail: e.to_string() }
    }

    /// The next byte, or `None` at the end of the stream.
    pub(super) fn next_byte(&mut self) -> Result<Option<u8>, PickleError> {
        let buf = self.r.fill_buf().map_err(Self::io(self.pos))?;
        let Some(&b) = buf.first() else { return Ok(None) };
        self.r.consume(1);
        self.pos += 1;
        Ok(Some(b))
    }

    /// Exactly `n` bytes into `out` (cleared first); `Ok(false)` when the stream ends before
    /// (`out` then holds what there was).
    pub(super) fn take_into(&mut self, n: u64, out: &mut Vec<u8>) -> Result<bool, PickleError> {
        out.clear();
        let mut left = n;
        while left > 0 {
            let buf = self.r.fill_buf().map_err(Self::io(self.pos))?;
            if buf.is_empty() {
                return Ok(false);
            }
            let k = buf.len().min(usize::try_from(left).unwrap_or(usize::MAX));
            out.extend_from_slice(buf.get(..k).unwrap_or_default());
            self.r.consume(k);
            self.pos += k as u64;
            left -= k as u64;
        }
        Ok(true)
    }

    /// Bytes up to a `\n` (consumed, not returned); `Ok(false)` when there is none within
    /// [`MAX_LINE`] bytes.
    pub(super) fn line_into(&mut self, out: &mut Vec<u8>) -> Result<bool, PickleError> {
        out.clear();
        loop {
            let buf = self.r.fill_buf().map_err(Self::io(self.pos))?;
            if buf.is_empty() {
                return Ok(false);
            }
            let (k, done) = match buf.iter().position(|&b| b == b'\n') {
                Some(i) => (i + 1, true),
                None => (buf.len(), false),
            };
            out.extend_from_slice(buf.get(..k).unwrap_or_default());
            self.r.consume(k);
            self.pos += k as u64;
            if done {
                out.pop();
                return Ok(true);
            }
            if out.len() > MAX_LINE {
                return Ok(false);
            }
        }
    }

    pub(super) fn at_end(&mut self) -> Result<bool, PickleError> {
        Ok(self.r.fill_buf().map_err(Self::io(self.pos))?.is_empty())
    }
}
