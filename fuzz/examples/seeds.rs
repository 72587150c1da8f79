//! Writes the seed inputs into `DIR/TARGET/seed-NAME` (default DIR: fuzz/corpus), for
//! `scripts/fuzz.sh`. Existing corpus files are left alone.

use std::path::PathBuf;

fn main() -> std::io::Result<()> {
    let dir = PathBuf::from(
        std::env::args()
            .nth(1)
            .unwrap_or_else(|| "fuzz/corpus".into()),
    );
    for (target, seeds) in fusex_fuzz::seeds::all() {
        let d = dir.join(target);
        std::fs::create_dir_all(&d)?;
        for (name, bytes) in seeds {
            std::fs::write(d.join(format!("seed-{name}")), bytes)?;
        }
    }
    Ok(())
}
