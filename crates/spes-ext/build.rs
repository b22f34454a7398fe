//! Compiles csrc/*.cpp against the libtorch that torch-sys (hence tch) links, with the same
//! C++ ABI flags, so tensors cross the boundary as the `torch::Tensor*` torch-sys hands out.
//!
//! c10d's Gloo process group is compiled into libtorch_cpu, but the PyPI wheel ships no Gloo
//! headers, which ProcessGroupGloo.hpp includes: they come from the system (Debian/Ubuntu
//! `libgloo-dev`, which scripts/setup.sh installs) or from `GLOO_INCLUDE`. Only declarations
//! are used; every Gloo symbol resolves inside libtorch_cpu.

use std::path::PathBuf;

fn main() {
    println!("cargo:rerun-if-changed=csrc/ext.cpp");
    println!("cargo:rerun-if-changed=csrc/c10d.cpp");
    println!("cargo:rerun-if-changed=csrc/guard.h");
    println!("cargo:rerun-if-env-changed=LIBTORCH_CXX11_ABI");
    println!("cargo:rerun-if-env-changed=GLOO_INCLUDE");
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
    let abi = std::env::var("LIBTORCH_CXX11_ABI").unwrap_or_else(|_| "1".into());
    cc::Build::new()
        .cpp(true)
        .pic(true)
        .warnings(false)
        .include(root.join("include"))
        .include(root.join("include/torch/csrc/api/include"))
        .include(&gloo)
        .define("USE_C10D_GLOO", None)
        .flag("-std=c++17")
        .flag(format!("-D_GLIBCXX_USE_CXX11_ABI={abi}"))
        .flag("-DGLOG_USE_GLOG_EXPORT")
        .file("csrc/ext.cpp")
        .file("csrc/c10d.cpp")
        .compile("spes_ext");
}
