//! glibc malloc tuning: the binary's only `unsafe` code, kept in this one module.
//!
//! The workspace denies `unsafe_code` (`Cargo.toml`); the two calls below are FFI into the C
//! allocator, which `libc` only exposes as `unsafe fn`, and neither has a safe wrapper in the
//! dependencies. Both take plain integers and touch no Rust-owned memory. A test
//! (`tests/integration/architecture.rs`) fails if `unsafe` appears in any other file.
#![allow(unsafe_code)]

/// Hands memory the allocator holds free back to the system, so that what a finished phase
/// freed does not stay resident through the next one (glibc keeps it otherwise; other
/// allocators return it on their own).
pub fn return_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only releases free pages of the allocator's own heaps; it takes an
    // integer (the padding to keep) and reads or writes no memory the program owns.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// Makes every allocation of 256 KiB or more its own mapping, returned to the system when
/// freed. glibc otherwise raises that threshold once a large buffer is freed and serves the next
/// ones from its heaps, where freed I/O buffers stay resident for the rest of the run.
pub fn map_large_buffers() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only changes a tuning parameter of the allocator (two integers); blocks
    // already allocated keep their place, only later allocations are served differently.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 256 << 10);
    }
}
