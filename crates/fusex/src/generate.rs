//! `fusex generate man|completions`: man pages and shell completions straight from the clap
//! definitions, so they cannot drift from the options the binary accepts.

use std::path::Path;

use anyhow::{Context, Result};
use clap::CommandFactory;

use crate::cli::{Cli, Generate};

/// Writes what `what` asks for.
pub fn run(what: Generate) -> Result<()> {
    match what {
        Generate::Man { dir } => man(&dir),
        Generate::Completions { shell, dir } => {
            create(&dir)?;
            let mut cmd = Cli::command();
            let path = clap_complete::generate_to(shell, &mut cmd, "fusex", &dir)
                .with_context(|| format!("writing {shell} completions into {}", dir.display()))?;
            tracing::debug!("wrote {}", path.display());
            Ok(())
        }
    }
}

fn create(dir: &Path) -> Result<()> {
    std::fs::create_dir_all(dir).with_context(|| {
        format!(
            "cannot create {}: give a directory fusex may write",
            dir.display()
        )
    })
}

/// fusex.1, and fusex-SUB.1 for every subcommand that is not hidden.
fn man(dir: &Path) -> Result<()> {
    create(dir)?;
    let cmd = Cli::command();
    let write = |name: &str, page: clap::Command| -> Result<()> {
        let mut out = Vec::new();
        clap_mangen::Man::new(page).render(&mut out)?;
        let path = dir.join(format!("{name}.1"));
        std::fs::write(&path, out).with_context(|| format!("writing {}", path.display()))
    };
    for sub in cmd.get_subcommands().filter(|s| !s.is_hide_set()) {
        let name = format!("fusex-{}", sub.get_name());
        let page = sub
            .clone()
            .display_name(name.clone())
            .bin_name(format!("fusex {}", sub.get_name()));
        write(&name, page)?;
    }
    write("fusex", cmd)
}
