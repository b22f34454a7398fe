//! `spes capabilities`: what this binary was built with and what it can do on this machine
//! (CUDA, the NCCL part, the grouped MoE kernel, the libtorch it links), so a GPU check can
//! refuse a binary that lacks what it will test before spending device time on it.

use crate::device::{select, DeviceChoice};
use anyhow::Result;
use serde::Serialize;
use tch::{Device, Kind};

/// Print what this binary can do here.
#[derive(clap::Args)]
pub struct Args {
    /// One JSON object instead of lines.
    #[arg(long)]
    json: bool,
}

/// The report; its JSON is what `scripts/gpu-check.sh` reads.
#[derive(Debug, Serialize)]
struct Capabilities {
    version: &'static str,
    /// The libtorch the binary was built against.
    libtorch: &'static str,
    /// Whether that libtorch has CUDA, and its release ("13.0", or "none").
    cuda_built: bool,
    cuda_release: &'static str,
    /// Whether spes-ext's CUDA part (NCCL process groups, device queries) is in the binary.
    nccl: bool,
    /// Whether a CUDA device is usable now.
    cuda_available: bool,
    /// Device 0's name and compute capability.
    gpu: Option<String>,
    sm: Option<String>,
    /// The NCCL version of the CUDA part, where it loads.
    nccl_version: Option<String>,
    /// Whether `train.moe_kernel = "auto"` takes the grouped kernel in bf16 here.
    grouped_kernel: bool,
}

/// `spes capabilities`: the build's facts and this machine's device, as lines or JSON.
pub fn run(a: Args) -> Result<()> {
    let device = select(DeviceChoice::Auto)?;
    let cuda = match device {
        Device::Cuda(i) => Some(spes_ext::nccl::cuda_device(i)),
        _ => None,
    };
    let gpu = cuda.as_ref().and_then(|d| d.as_ref().ok());
    let c = Capabilities {
        version: env!("CARGO_PKG_VERSION"),
        libtorch: spes_ext::BUILT_LIBTORCH,
        cuda_built: spes_ext::BUILT_CUDA != "none",
        cuda_release: spes_ext::BUILT_CUDA,
        nccl: spes_ext::nccl::built(),
        cuda_available: device.is_cuda(),
        gpu: gpu.map(|d| d.name.clone()),
        sm: gpu.map(|d| format!("{}.{}", d.major, d.minor)),
        nccl_version: device
            .is_cuda()
            .then(spes_ext::nccl::version)
            .and_then(Result::ok)
            .map(|(a, b, c)| format!("{a}.{b}.{c}")),
        grouped_kernel: spes_train::grouped_kernel_native(device, Kind::BFloat16),
    };
    if a.json {
        println!("{}", serde_json::to_string(&c)?);
        return Ok(());
    }
    let yes = |b: bool| if b { "yes" } else { "no" };
    println!("spes {} built against libtorch {}", c.version, c.libtorch);
    println!(
        "CUDA in the build: {} ({}); NCCL part: {}",
        yes(c.cuda_built),
        c.cuda_release,
        yes(c.nccl)
    );
    match (&c.gpu, &cuda) {
        (Some(name), _) => println!(
            "GPU 0: {name}, SM {}; NCCL {}",
            c.sm.as_deref().unwrap_or("?"),
            c.nccl_version.as_deref().unwrap_or("not loaded")
        ),
        (None, Some(Err(e))) => println!("GPU 0: usable, but not described: {e}"),
        (None, _) => println!("GPU: none usable (CPU only)"),
    }
    println!(
        "grouped MoE kernel by default: {}",
        if c.grouped_kernel {
            "yes (bf16)"
        } else {
            "no (the loop)"
        }
    );
    Ok(())
}
