//! Compiles csrc/ext.cpp against the libtorch that torch-sys (hence tch) links, with the same
//! C++ ABI flags, so tensors cross the boundary as the `torch::Tensor*` torch-sys hands out.

use std::path::PathBuf;

fn main() {
    println!("cargo:rerun-if-changed=csrc/ext.cpp");
    println!("cargo:rerun-if-env-changed=LIBTORCH_CXX11_ABI");
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
        .flag("-std=c++17")
        .flag(format!("-D_GLIBCXX_USE_CXX11_ABI={abi}"))
        .flag("-DGLOG_USE_GLOG_EXPORT")
        .file("csrc/ext.cpp")
        .compile("spes_ext");
}
