//! Picking the compute device. The binary links only libtorch's CPU library; the CUDA backend
//! (`libtorch_cuda.so`) is loaded at run time when present, so one binary starts on CPU-only
//! machines (even with a torch install lacking CUDA libraries) and uses a GPU where there is one.

use anyhow::{bail, Result};
use clap::ValueEnum;
use tch::Device;

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum DeviceChoice {
    /// CUDA device 0 when one is usable, else the CPU.
    Auto,
    Cpu,
    Cuda,
}

impl DeviceChoice {
    /// The `--device` value naming this choice, as child processes are given it.
    pub fn arg(self) -> String {
        let value = self.to_possible_value().expect("every choice is named");
        value.get_name().to_owned()
    }
}

/// Loads libtorch's CUDA backend so its kernels and device hooks register.
fn load_cuda_backend() -> Result<(), String> {
    // SAFETY: loading a shared library runs its initialisers; libtorch_cuda's only register
    // kernels with the already-loaded libtorch_cpu. The handle is kept for the process lifetime.
    let lib = unsafe {
        libloading::os::unix::Library::open(
            Some("libtorch_cuda.so"),
            libloading::os::unix::RTLD_NOW | libloading::os::unix::RTLD_GLOBAL,
        )
    }
    .map_err(|e| e.to_string())?;
    std::mem::forget(lib);
    Ok(())
}

/// Resolves `--device`, explaining why CUDA is not usable when it was asked for.
pub fn select(choice: DeviceChoice) -> Result<Device> {
    if choice == DeviceChoice::Cpu {
        return Ok(Device::Cpu);
    }
    let loaded = load_cuda_backend();
    let usable = loaded.is_ok() && tch::Cuda::is_available();
    match (choice, usable) {
        (_, true) => Ok(Device::Cuda(0)),
        (DeviceChoice::Auto, false) => Ok(Device::Cpu),
        (_, false) => match loaded {
            Err(e) => bail!("--device cuda: cannot load libtorch's CUDA backend: {e}"),
            Ok(()) => bail!("--device cuda: libtorch's CUDA backend loaded but sees no GPU"),
        },
    }
}
