// Compiles proto/spes.proto with protox (pure Rust), so building needs no `protoc` binary.
fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto/spes.proto");
    let fds = protox::compile(["spes.proto"], ["proto"])?;
    tonic_prost_build::configure().compile_fds(fds)?;
    Ok(())
}
