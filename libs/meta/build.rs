//! Generates the etcd v3 client (the subset in `proto/etcd_v3.proto`). protoc comes from `PROTOC`
//! if set, otherwise the vendored binary, so a fresh machine needs no system protoc (the reason
//! lunakv does not use the etcd-client crate, whose build script requires one).

fn main() -> Result<(), Box<dyn std::error::Error>> {
    if std::env::var_os("PROTOC").is_none() {
        let protoc = protoc_bin_vendored::protoc_bin_path()?;
        // SAFETY: build scripts are single-threaded; nothing else reads the environment concurrently.
        #[allow(clippy::disallowed_methods)] // the ban targets threaded code; see the SAFETY note
        unsafe {
            std::env::set_var("PROTOC", protoc)
        };
    }
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("proto");
    let file = root.join("etcd_v3.proto");
    println!("cargo:rerun-if-changed={}", file.display());
    tonic_prost_build::configure()
        .build_server(false)
        .build_client(true)
        .compile_protos(&[file], &[root])?;
    Ok(())
}
