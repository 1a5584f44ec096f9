//! Generates the tonic/prost code from `proto/`. protoc comes from `PROTOC` if set, otherwise the
//! vendored binary, so a fresh machine needs no system protoc.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    if std::env::var_os("PROTOC").is_none() {
        let protoc = protoc_bin_vendored::protoc_bin_path()?;
        // SAFETY: build scripts are single-threaded; nothing else reads the environment concurrently.
        #[allow(clippy::disallowed_methods)] // the ban targets threaded code; see the SAFETY note
        unsafe {
            std::env::set_var("PROTOC", protoc)
        };
    }
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../proto");
    let files = ["lunakv/master.proto", "lunakv/bootstrap.proto"].map(|f| root.join(f));
    for f in &files {
        println!("cargo:rerun-if-changed={}", f.display());
    }
    // For gRPC server reflection (grpcurl, grpcio's reflection client).
    let descriptors =
        std::path::PathBuf::from(std::env::var("OUT_DIR")?).join("lunakv_descriptor.bin");
    tonic_prost_build::configure()
        .file_descriptor_set_path(descriptors)
        .build_server(true)
        .build_client(true)
        .compile_protos(&files, &[root])?;
    Ok(())
}
