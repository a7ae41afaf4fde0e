//! `tiacc_training._engine`: the Python face of `tiacc-core`.
//!
//! Conversion only: every function converts its arguments, releases the GIL
//! around the engine call, and maps engine errors with `errors::to_pyerr`.

use pyo3::prelude::*;

mod amp;
mod comm;
mod config;
mod dataset;
mod device;
mod errors;
mod features;
mod nccl;
#[cfg(feature = "nccl-communicator")]
mod nccl_communicator;
mod pack;
mod records;
mod state;
mod store;

/// The compiled part of tiacc-training: the bindings of `rust/tiacc-py`.
///
/// Type aliases:
///     _Path = Union[str, PathLike[str]]: A file or folder, as text or an `os.PathLike`.
///     EngineCounters = dict[str, Any]: What an engine carried on one `(path, codec)`
///         (`tiacc_core::comm::counters`): `buckets`, `bytes_in` and `wire_bytes`
///         (ints), and `wire`, the bytes sent per group (`world`, `intra`, `inter`).
#[pymodule]
fn _engine(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    errors::register(m)?;
    m.add_function(wrap_pyfunction!(records::crc32c, m)?)?;
    m.add_function(wrap_pyfunction!(records::masked_crc32c, m)?)?;
    m.add_function(wrap_pyfunction!(records::frame_record, m)?)?;
    m.add_function(wrap_pyfunction!(records::encode_example, m)?)?;
    m.add_function(wrap_pyfunction!(records::decode_example, m)?)?;
    m.add_function(wrap_pyfunction!(records::verify_shard, m)?)?;
    m.add_function(wrap_pyfunction!(records::verify_index, m)?)?;
    m.add_function(wrap_pyfunction!(records::read_index, m)?)?;
    m.add_function(wrap_pyfunction!(records::build_index, m)?)?;
    m.add_class::<records::RecordReader>()?;
    m.add_class::<records::RecordIterator>()?;
    m.add_class::<records::RecordWriter>()?;
    m.add_class::<records::ShardedWriter>()?;
    m.add_class::<pack::ImagePacker>()?;
    m.add_class::<dataset::IndexedDataset>()?;
    m.add_class::<dataset::EncodedImages>()?;
    m.add_class::<dataset::Sampler>()?;
    m.add_function(wrap_pyfunction!(dataset::torch_cpu_uniform, m)?)?;
    m.add_function(wrap_pyfunction!(dataset::data_gil_released_seconds, m)?)?;
    m.add_function(wrap_pyfunction!(config::comm_config, m)?)?;
    m.add_class::<config::PyCommConfig>()?;
    m.add_function(wrap_pyfunction!(comm::launch_env, m)?)?;
    m.add_function(wrap_pyfunction!(comm::random_token, m)?)?;
    m.add_function(wrap_pyfunction!(store::wait_for, m)?)?;
    m.add_function(wrap_pyfunction!(comm::local_addr_towards, m)?)?;
    m.add_function(wrap_pyfunction!(comm::network_interfaces, m)?)?;
    m.add_function(wrap_pyfunction!(comm::outward_interface, m)?)?;
    m.add_function(wrap_pyfunction!(comm::slow_ranks, m)?)?;
    m.add_function(wrap_pyfunction!(comm::collective_dtypes, m)?)?;
    m.add_function(wrap_pyfunction!(comm::collective_ops, m)?)?;
    m.add_function(wrap_pyfunction!(config::check_same_config, m)?)?;
    m.add_function(wrap_pyfunction!(config::nccl_allows_shared_gpu, m)?)?;
    m.add(
        "NCCL_MULTI_RANK_GPU_SINCE",
        tiacc_core::config::NCCL_MULTI_RANK_GPU_SINCE,
    )?;
    m.add_class::<comm::CommEngine>()?;
    m.add_class::<comm::SharedResult>()?;
    m.add_class::<device::DeviceEngine>()?;
    m.add_class::<amp::AmpPolicy>()?;
    m.add_function(wrap_pyfunction!(amp::amp_constants, m)?)?;
    m.add_function(wrap_pyfunction!(nccl::nccl_version, m)?)?;
    m.add_function(wrap_pyfunction!(nccl::nccl_library_path, m)?)?;
    m.add_function(wrap_pyfunction!(nccl::nccl_unique_id, m)?)?;
    #[cfg(feature = "nccl-communicator")]
    m.add_class::<nccl_communicator::NcclCommunicator>()?;
    Ok(())
}
