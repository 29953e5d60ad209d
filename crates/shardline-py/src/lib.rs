//! `shardline._native`: the Rust half of the `shardline` Python package. Each function here is a
//! thin shell over a library crate: it converts arguments, releases the GIL while bytes move, and
//! turns errors into `shardline.ShardlineError` carrying the same message the CLI prints. The
//! Python half (`python/shardline/`) shapes results into numpy arrays and torch tensors.

// The formats crate's errors carry paths and keys for their messages; they are built only on
// the way out (see the same allowance there).
#![allow(clippy::result_large_err)]

mod objects;
mod ops;
mod reader;
mod training;

use pyo3::create_exception;
use pyo3::exceptions::PyException;
use pyo3::prelude::*;
use shardline_formats::error_message;

create_exception!(shardline, ShardlineError, PyException, "An error Shardline reports: the CLI's message, whole.");

/// Runs `work` with the GIL released (bytes move meanwhile; other Python threads run), its
/// error becoming a `ShardlineError` with the CLI's message.
pub(crate) fn without_gil<T, E>(py: Python<'_>, work: impl FnOnce() -> Result<T, E> + Send) -> PyResult<T>
where
    T: Send,
    E: std::error::Error + 'static,
{
    py.detach(|| work().map_err(|e| error_message(&e))).map_err(ShardlineError::new_err)
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("ShardlineError", m.py().get_type::<ShardlineError>())?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add_class::<reader::Checkpoint>()?;
    m.add_class::<objects::PickledObject>()?;
    m.add_class::<ops::ValidationReport>()?;
    m.add_function(wrap_pyfunction!(ops::convert, m)?)?;
    m.add_function(wrap_pyfunction!(ops::plan, m)?)?;
    m.add_function(wrap_pyfunction!(ops::validate, m)?)?;
    m.add_function(wrap_pyfunction!(training::reshard, m)?)?;
    m.add_function(wrap_pyfunction!(training::export, m)?)?;
    Ok(())
}
