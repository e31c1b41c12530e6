//! The native half of the `gradwire` Python package (PyO3): the reference Python layout
//! (`gradwire.reference`) and the library's compressors (`gradwire.Compressor`) over numpy
//! arrays. The Python half (`python/gradwire/`) converts arguments (torch tensors, dtypes,
//! shapes) and gives the functions the reference module's signatures; everything that
//! compresses, decodes or checks bytes runs here, with the GIL released.
//!
//! No `unsafe` in this crate: PyO3's and numpy's safe APIs only.
#![forbid(unsafe_code)]

mod allreduce;
mod comm;
mod compressor;
mod errors;
mod reference;

use pyo3::prelude::*;

/// The extension module `gradwire._native`.
#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("GradwireError", py.get_type::<errors::GradwireError>())?;
    m.add("PayloadError", py.get_type::<errors::PayloadError>())?;
    m.add_function(wrap_pyfunction!(reference::reference_compress, m)?)?;
    m.add_function(wrap_pyfunction!(reference::reference_decode, m)?)?;
    m.add_function(wrap_pyfunction!(reference::reference_pack, m)?)?;
    m.add_function(wrap_pyfunction!(reference::topk_count, m)?)?;
    m.add_class::<compressor::Compressor>()?;
    m.add_class::<allreduce::AllReduce>()?;
    m.add_class::<allreduce::Pending>()?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
