//! GPU discovery for workers. With the `cuda` feature, devices are counted through the CUDA
//! driver (cudarc, loaded at run time); without it, or without a driver, there are none and
//! `--gpus` declares them.

/// Device indices of the GPUs this machine has.
#[cfg(feature = "cuda")]
pub fn discover() -> Vec<u32> {
    match cudarc::driver::result::init().and_then(|_| cudarc::driver::result::device::get_count()) {
        Ok(n) => (0..n.max(0) as u32).collect(),
        Err(e) => {
            eprintln!("note: no CUDA devices found ({e:?}); declare GPUs with --gpus");
            Vec::new()
        }
    }
}

/// Device indices of the GPUs this machine has (none: built without the `cuda` feature).
#[cfg(not(feature = "cuda"))]
pub fn discover() -> Vec<u32> {
    Vec::new()
}
