//! Compiles csrc/*.cpp against the libtorch that torch-sys (hence tch) links, with the same
//! C++ ABI flags, so tensors cross the boundary as the `torch::Tensor*` torch-sys hands out.
//!
//! c10d's Gloo process group is compiled into libtorch_cpu, but the PyPI wheel ships no Gloo
//! headers, which ProcessGroupGloo.hpp includes: they come from the system (Debian/Ubuntu
//! `libgloo-dev`, which scripts/setup.sh installs) or from `GLOO_INCLUDE`. Only declarations
//! are used; every Gloo symbol resolves inside libtorch_cpu.
//!
//! The NCCL part (csrc/nccl.cpp) is a shared library of its own, linked against
//! libtorch_cuda and embedded in the crate (src/nccl.rs loads it when a run asks for NCCL), so
//! the binary itself links only the CPU libraries. It is built where the CUDA wheels' headers
//! are: site-packages/nvidia/cu13 (runtime, plus nvidia-cuda-crt and nvidia-cuda-cccl, which
//! scripts/setup.sh installs) and nvidia/nccl, or `CUDA_INCLUDE` and `NCCL_INCLUDE`. A libtorch
//! without CUDA builds spes without the part; a libtorch with CUDA whose headers are missing
//! fails the build (a GPU binary without its NCCL part would only fail on the GPU), unless
//! `SPES_NO_NCCL` asks for a build without it.
//!
//! `SPES_BUILD_LIBTORCH` and `SPES_BUILD_CUDA` tell `spes capabilities` what it was built
//! against.

use std::path::{Path, PathBuf};
use std::process::Command;

fn main() {
    for f in [
        "csrc/ext.cpp",
        "csrc/count.cpp",
        "csrc/grouped.cpp",
        "csrc/c10d.cpp",
        "csrc/guard.h",
        "csrc/nccl.cpp",
    ] {
        println!("cargo:rerun-if-changed={f}");
    }
    for v in [
        "LIBTORCH_CXX11_ABI",
        "GLOO_INCLUDE",
        "CUDA_INCLUDE",
        "NCCL_INCLUDE",
        "SPES_NO_NCCL",
    ] {
        println!("cargo:rerun-if-env-changed={v}");
    }
    println!("cargo::rustc-check-cfg=cfg(spes_nccl)");
    let gloo =
        PathBuf::from(std::env::var("GLOO_INCLUDE").unwrap_or_else(|_| "/usr/include".into()));
    if !gloo.join("gloo/algorithm.h").exists() {
        panic!(
            "spes-ext needs Gloo's C++ headers for c10d's process group: {} has no gloo/algorithm.h. \
             Install them (Debian/Ubuntu: apt-get install libgloo-dev; scripts/setup.sh does) or \
             point GLOO_INCLUDE at a directory holding gloo/.",
            gloo.display()
        );
    }
    let lib = PathBuf::from(
        std::env::var("DEP_TCH_LIBTORCH_LIB")
            .expect("torch-sys did not report its libtorch lib directory (DEP_TCH_LIBTORCH_LIB)"),
    );
    let root = lib
        .parent()
        .expect("libtorch lib directory has a parent")
        .to_path_buf();
    println!(
        "cargo:rustc-env=SPES_BUILD_LIBTORCH={}",
        libtorch_version(&root)
    );
    let abi = std::env::var("LIBTORCH_CXX11_ABI").unwrap_or_else(|_| "1".into());
    let mut build = cc::Build::new();
    build
        .cpp(true)
        .pic(true)
        .warnings(false)
        .include(root.join("include"))
        .include(root.join("include/torch/csrc/api/include"))
        .flag("-std=c++17")
        .flag(format!("-D_GLIBCXX_USE_CXX11_ABI={abi}"))
        // As libtorch itself is built: headers whose debug-only members and checks depend on
        // NDEBUG (RecordFunction's) must see the release layout.
        .define("NDEBUG", None)
        .flag("-DGLOG_USE_GLOG_EXPORT");
    let nccl_build = build.clone();
    build
        .include(&gloo)
        .define("USE_C10D_GLOO", None)
        .file("csrc/ext.cpp")
        .file("csrc/count.cpp")
        .file("csrc/grouped.cpp")
        .file("csrc/c10d.cpp")
        .compile("spes_ext");
    let cuda = root.join("lib/libtorch_cuda.so").exists();
    println!(
        "cargo:rustc-env=SPES_BUILD_CUDA={}",
        if cuda {
            cuda_version(&root)
        } else {
            "none".into()
        }
    );
    if !cuda || std::env::var_os("SPES_NO_NCCL").is_some() {
        return;
    }
    match cuda_headers(&root) {
        Ok(includes) => {
            let so = build_nccl(&nccl_build, &includes, &lib);
            println!("cargo:rustc-cfg=spes_nccl");
            println!("cargo:rustc-env=SPES_NCCL_SO={}", so.display());
        }
        Err(missing) => panic!(
            "spes-ext: libtorch has CUDA but its NCCL part cannot be built: {missing}. Run \
             scripts/setup.sh (it installs the CUDA host headers), or set SPES_NO_NCCL=1 for a \
             binary whose GPU nodes use Gloo"
        ),
    }
}

/// "2.11.0" from libtorch's version header; "unknown" where it has none.
fn libtorch_version(torch: &Path) -> String {
    let header = std::fs::read_to_string(torch.join("include/torch/headeronly/version.h"))
        .unwrap_or_default();
    let part = |name: &str| {
        header.lines().find_map(|l| {
            let rest = l.trim().strip_prefix("#define ")?.strip_prefix(name)?;
            rest.trim().parse::<u32>().ok()
        })
    };
    match (
        part("TORCH_VERSION_MAJOR"),
        part("TORCH_VERSION_MINOR"),
        part("TORCH_VERSION_PATCH"),
    ) {
        (Some(a), Some(b), Some(c)) => format!("{a}.{b}.{c}"),
        _ => "unknown".into(),
    }
}

/// The CUDA release the wheel was built for ("13.0"), from its version.py.
fn cuda_version(torch: &Path) -> String {
    std::fs::read_to_string(torch.join("version.py"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| {
            let v = l.strip_prefix("cuda")?.split('\'').nth(1)?;
            Some(v.to_owned())
        })
        .unwrap_or_else(|| "unknown".into())
}

/// Include directories for the NCCL part: CUDA runtime (with crt/ and CCCL's nv/) and NCCL.
fn cuda_headers(torch: &Path) -> Result<Vec<PathBuf>, String> {
    let site = torch
        .canonicalize()
        .ok()
        .and_then(|t| t.parent().map(Path::to_path_buf))
        .unwrap_or_default();
    let from_env = |v: &str| std::env::var_os(v).map(PathBuf::from);
    let cuda = from_env("CUDA_INCLUDE").unwrap_or_else(|| site.join("nvidia/cu13/include"));
    let nccl = from_env("NCCL_INCLUDE").unwrap_or_else(|| site.join("nvidia/nccl/include"));
    let mut includes = vec![cuda.clone(), nccl.clone()];
    if cuda.join("cccl").is_dir() {
        includes.push(cuda.join("cccl"));
    }
    for (file, what) in [
        ("cuda_runtime_api.h", "the CUDA runtime headers"),
        ("crt/host_config.h", "nvidia-cuda-crt's headers"),
        ("nv/target", "nvidia-cuda-cccl's headers"),
        ("nccl.h", "nccl.h"),
    ] {
        if !includes.iter().any(|d| d.join(file).exists()) {
            return Err(format!(
                "no {what} ({file}) under {} or {}; scripts/setup.sh installs them, or set CUDA_INCLUDE / NCCL_INCLUDE",
                cuda.display(),
                nccl.display()
            ));
        }
    }
    Ok(includes)
}

/// Compiles csrc/nccl.cpp into `$OUT_DIR/libspes_nccl.so`, linked against libtorch_cuda.
fn build_nccl(base: &cc::Build, includes: &[PathBuf], lib: &Path) -> PathBuf {
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    let so = out.join("libspes_nccl.so");
    let mut b = base.clone();
    b.define("USE_C10D_NCCL", None).opt_level(2);
    for i in includes {
        b.include(i);
    }
    let mut cmd: Command = b.get_compiler().to_command();
    cmd.args(["-shared", "-w", "-o"])
        .arg(&so)
        .arg("csrc/nccl.cpp")
        .arg(format!("-L{}", lib.display()))
        .args(["-ltorch_cuda", "-lc10_cuda", "-ltorch_cpu", "-lc10"])
        .arg(format!("-Wl,-rpath,{}", lib.display()));
    let status = cmd
        .status()
        .unwrap_or_else(|e| panic!("cannot run the C++ compiler for csrc/nccl.cpp: {e}"));
    assert!(status.success(), "compiling csrc/nccl.cpp failed: {cmd:?}");
    so
}
