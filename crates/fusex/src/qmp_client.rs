//! A small QMP client of a fusex control socket, shared by `fusex ctl` and `fusex top`: connect,
//! read the greeting, negotiate capabilities, run commands one at a time and keep the events
//! that arrive in between.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{anyhow, bail, Context, Result};
use serde_json::{json, Value};

/// How long a command may take by default (an export's mount, a safe removal's flush).
pub const REPLY_TIMEOUT: Duration = Duration::from_secs(300);

/// A connection in command mode.
pub struct Client {
    out: UnixStream,
    lines: BufReader<UnixStream>,
    /// Events read while waiting for replies, oldest first.
    pub events: Vec<Value>,
}

impl Client {
    /// Connects to `path`, checks the greeting and leaves capabilities negotiation behind.
    pub fn connect(path: &Path) -> Result<Client> {
        let s = UnixStream::connect(path).map_err(|e| {
            anyhow!(
                "cannot reach fusex serve at {} ({e}): is it running? (--control PATH names \
                 another socket)",
                path.display()
            )
        })?;
        s.set_read_timeout(Some(REPLY_TIMEOUT))?;
        let mut c = Client {
            out: s.try_clone()?,
            lines: BufReader::new(s),
            events: Vec::new(),
        };
        let greeting = c.read()?;
        if greeting.get("QMP").is_none() {
            bail!("{} is not a QMP socket", path.display());
        }
        c.execute("qmp_capabilities", json!({}))?;
        Ok(c)
    }

    /// How long a reply may take from now on (a viewer gives up sooner than a command does).
    pub fn set_reply_timeout(&mut self, t: Duration) -> Result<()> {
        self.lines.get_ref().set_read_timeout(Some(t))?;
        Ok(())
    }

    fn read(&mut self) -> Result<Value> {
        let mut line = String::new();
        if self
            .lines
            .read_line(&mut line)
            .context("reading the reply")?
            == 0
        {
            bail!("fusex serve closed the connection");
        }
        serde_json::from_str(&line).context("the daemon's reply is not JSON")
    }

    /// Runs `cmd` with `args`; its `return` value, or its error's description as the error.
    pub fn execute(&mut self, cmd: &str, args: Value) -> Result<Value> {
        let req = json!({"execute": cmd, "arguments": args});
        writeln!(self.out, "{req}").context("sending the command")?;
        loop {
            let m = self.read()?;
            if m.get("event").is_some() {
                self.events.push(m);
                continue;
            }
            if let Some(r) = m.get("return") {
                return Ok(r.clone());
            }
            bail!(
                "{}",
                m["error"]["desc"].as_str().unwrap_or("the daemon refused")
            );
        }
    }

    /// Waits for `BLOCK_EXPORT_DELETED` of `id`.
    pub fn wait_deleted(&mut self, id: &str) -> Result<()> {
        let is = |e: &Value| e["event"] == "BLOCK_EXPORT_DELETED" && e["data"]["id"] == id;
        while !self.events.iter().any(is) {
            let m = self.read()?;
            if m.get("event").is_some() {
                self.events.push(m);
            }
        }
        Ok(())
    }
}

/// The socket `fusex serve` uses when given none (and so where its clients look first).
pub fn default_socket() -> PathBuf {
    // SAFETY: geteuid has no preconditions.
    let uid = unsafe { libc::geteuid() };
    crate::runtime::control_socket(&crate::runtime::dir_for(uid))
}
