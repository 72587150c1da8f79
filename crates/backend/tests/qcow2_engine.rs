//! qcow2 through the engine, without FUSE: many concurrent tasks on one engine writing and reading
//! a fresh image, checked against an in-memory oracle, then `qemu-img check` when it exists.

use std::process::Command;
use std::rc::Rc;

use backend::{BlockBackend, Qcow2Backend, Qcow2Options};
use engine::{Engine, EngineConfig};

fn qemu_img() -> Option<std::path::PathBuf> {
    let out = Command::new("sh")
        .args(["-c", "command -v qemu-img"])
        .output()
        .ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).trim().into())
}

#[test]
fn concurrent_allocating_writes_read_back() {
    let Some(qemu_img) = qemu_img() else {
        assert!(std::env::var_os("CI").is_none(), "qemu-img missing in CI");
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("t.qcow2");
    let st = Command::new(&qemu_img)
        .args(["create", "-q", "-f", "qcow2", "-o", "cluster_size=4096"])
        .arg(&path)
        .arg("8M")
        .status()
        .unwrap();
    assert!(st.success());
    let b = Rc::new(
        Qcow2Backend::open(
            &path,
            Qcow2Options {
                writable: true,
                ..Qcow2Options::default()
            },
        )
        .unwrap(),
    );
    let eng = Rc::new(
        Engine::new(&EngineConfig {
            buffers: 32,
            buffer_size: 65536,
            ..EngineConfig::default()
        })
        .unwrap(),
    );
    let tasks = 16u64;
    for t in 0..tasks {
        let (b, e) = (b.clone(), eng.clone());
        eng.spawn(async move {
            for i in 0..8u64 {
                let off = (i * tasks + t) * 12288 + 100;
                let mut buf = e.take_buffer().unwrap();
                let fill = (t * 8 + i) as u8 | 1;
                buf.as_mut_slice()[..10000].fill(fill);
                let (r, win) = b.write_at(&e, buf.slice(0..10000), off).await;
                assert_eq!(r.unwrap(), 10000);
                let mut buf = win.into_inner();
                buf.as_mut_slice().fill(0);
                let (r, win) = b.read_at(&e, buf.slice(0..10000), off).await;
                assert_eq!(r.unwrap(), 10000);
                assert!(
                    win.as_slice().iter().all(|&x| x == fill),
                    "task {t} round {i}"
                );
            }
        });
    }
    eng.run().unwrap();
    eng.block_on(b.flush(&eng)).unwrap().unwrap();
    drop(b);
    let out = Command::new(&qemu_img)
        .arg("check")
        .arg(&path)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
}
