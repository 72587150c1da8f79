//! Fault injection: a backend wrapper that fails or delays chosen reads, writes and flushes, so
//! tests (and people evaluating fusex) can see what an application gets when the image's storage
//! fails one request, and that everything else keeps working.
//!
//! Rules come from `--fault OP:N:ACTION` (see [`FaultRule`]'s `FromStr`). Calls are counted per
//! operation across all queues; the `N`th call of `OP` gets `ACTION` (every call with `*`). Without rules the wrapper
//! costs one predictable branch per call.

use std::str::FromStr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use engine::{Engine, Slice};

use crate::{Attrs, BackendError, BlockBackend, Capabilities, Result, Seek};

/// The backend calls a rule can target.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FaultOp {
    /// `read_at`: one per FUSE READ.
    Read,
    /// `write_at`: one per FUSE WRITE.
    Write,
    /// `flush`: one per FUSE FLUSH or FSYNC of a writable export (and the exit flush).
    Flush,
}

/// What happens to the targeted call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FaultAction {
    /// Fails with this errno; the image is not touched.
    Fail(i32),
    /// Waits this long on the queue's ring (other requests keep being served), then runs.
    Delay(Duration),
}

/// [`FaultRule::nth`] for a rule that hits every call (`*`): a steady slow or failing disk.
pub const EVERY: u64 = 0;

/// One rule: the `nth` call (1-based; `EVERY`: each one) of `op` gets `action`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FaultRule {
    /// Which calls are counted.
    pub op: FaultOp,
    /// Which one of them is hit (1 = the first; `EVERY`: all).
    pub nth: u64,
    /// What it gets.
    pub action: FaultAction,
}

/// Why a `--fault` rule did not parse.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("bad fault rule {rule:?}: {why} (write OP:N:ACTION, e.g. write:3:eio, read:10:delay=200ms, read:*:delay=2ms; OP is read, write or flush; N counts from 1, * is every call; ACTION is eio, enospc or delay=MSms)")]
pub struct FaultParseError {
    rule: String,
    why: &'static str,
}

impl FromStr for FaultRule {
    type Err = FaultParseError;

    fn from_str(s: &str) -> std::result::Result<FaultRule, FaultParseError> {
        let bad = |why| FaultParseError {
            rule: s.to_string(),
            why,
        };
        let mut parts = s.split(':');
        let (Some(op), Some(nth), Some(action), None) =
            (parts.next(), parts.next(), parts.next(), parts.next())
        else {
            return Err(bad("it needs three parts"));
        };
        let op = match op {
            "read" => FaultOp::Read,
            "write" => FaultOp::Write,
            "flush" => FaultOp::Flush,
            _ => return Err(bad("unknown operation")),
        };
        let nth = match nth {
            "*" => EVERY,
            n => match n.parse::<u64>() {
                Ok(n) if n > 0 => n,
                _ => return Err(bad("N must be a whole number from 1, or * for every call")),
            },
        };
        let action = match action {
            "eio" => FaultAction::Fail(libc::EIO),
            "enospc" => FaultAction::Fail(libc::ENOSPC),
            a => {
                let ms = a
                    .strip_prefix("delay=")
                    .and_then(|d| d.strip_suffix("ms"))
                    .and_then(|d| d.parse::<u64>().ok())
                    .ok_or_else(|| bad("unknown action"))?;
                FaultAction::Delay(Duration::from_millis(ms))
            }
        };
        Ok(FaultRule { op, nth, action })
    }
}

/// The rules and the per-operation call counters.
#[derive(Debug)]
struct Plan {
    rules: Vec<FaultRule>,
    calls: [AtomicU64; 3],
}

impl Plan {
    /// Counts a call of `op` and returns the action of the rule it hits, if any.
    fn hit(&self, op: FaultOp) -> Option<FaultAction> {
        let n = self.calls[op as usize].fetch_add(1, Ordering::Relaxed) + 1;
        self.rules
            .iter()
            .find(|r| r.op == op && (r.nth == n || r.nth == EVERY))
            .map(|r| r.action)
    }
}

/// A backend whose chosen calls fail or wait (see the module docs); with no rules, the backend
/// itself.
pub struct Faulty<B> {
    inner: B,
    plan: Option<Box<Plan>>,
}

impl<B: BlockBackend> Faulty<B> {
    /// Wraps `inner` with `rules` (none: a plain pass-through).
    pub fn new(inner: B, rules: Vec<FaultRule>) -> Faulty<B> {
        let plan = (!rules.is_empty()).then(|| {
            Box::new(Plan {
                rules,
                calls: Default::default(),
            })
        });
        Faulty { inner, plan }
    }

    /// The wrapped backend.
    pub fn inner(&self) -> &B {
        &self.inner
    }

    /// Applies the rule a call of `op` hits: waits, or returns the errno to fail with.
    async fn inject(&self, eng: &Engine, op: FaultOp) -> Option<i32> {
        match self.plan.as_ref()?.hit(op)? {
            FaultAction::Fail(errno) => {
                tracing::info!("fault injected: {op:?} call fails with errno {errno}");
                Some(errno)
            }
            FaultAction::Delay(d) => {
                tracing::info!("fault injected: {op:?} call delayed by {d:?}");
                eng.sleep(d).await;
                None
            }
        }
    }
}

fn fail(errno: i32) -> BackendError {
    BackendError::Io(std::io::Error::from_raw_os_error(errno))
}

impl<B: BlockBackend> BlockBackend for Faulty<B> {
    fn size(&self) -> u64 {
        self.inner.size()
    }
    fn refresh_size(&self) -> Result<u64> {
        self.inner.refresh_size()
    }
    fn size_limit(&self) -> u64 {
        self.inner.size_limit()
    }
    fn capabilities(&self) -> Capabilities {
        self.inner.capabilities()
    }
    fn durable_writes(&self) -> bool {
        self.inner.durable_writes()
    }
    fn splice_fd(&self) -> Option<std::os::fd::RawFd> {
        // A spliced READ never calls read_at: with faults planned, every read takes that path.
        match self.plan {
            Some(_) => None,
            None => self.inner.splice_fd(),
        }
    }
    async fn attrs(&self, eng: &Engine) -> Result<Attrs> {
        self.inner.attrs(eng).await
    }
    async fn read_at(&self, eng: &Engine, win: Slice, off: u64) -> (Result<usize>, Slice) {
        if self.plan.is_some() {
            if let Some(errno) = self.inject(eng, FaultOp::Read).await {
                return (Err(fail(errno)), win);
            }
        }
        self.inner.read_at(eng, win, off).await
    }
    async fn write_at(&self, eng: &Engine, win: Slice, off: u64) -> (Result<usize>, Slice) {
        if self.plan.is_some() {
            if let Some(errno) = self.inject(eng, FaultOp::Write).await {
                return (Err(fail(errno)), win);
            }
        }
        self.inner.write_at(eng, win, off).await
    }
    async fn flush(&self, eng: &Engine) -> Result<()> {
        if self.plan.is_some() {
            if let Some(errno) = self.inject(eng, FaultOp::Flush).await {
                return Err(fail(errno));
            }
        }
        self.inner.flush(eng).await
    }
    async fn discard(&self, eng: &Engine, off: u64, len: u64) -> Result<()> {
        self.inner.discard(eng, off, len).await
    }
    async fn write_zeroes(&self, eng: &Engine, off: u64, len: u64) -> Result<()> {
        self.inner.write_zeroes(eng, off, len).await
    }
    async fn allocate(&self, eng: &Engine, off: u64, len: u64) -> Result<()> {
        self.inner.allocate(eng, off, len).await
    }
    async fn seek(&self, eng: &Engine, off: u64, whence: Seek) -> Result<Option<u64>> {
        self.inner.seek(eng, off, whence).await
    }
    async fn resize(&self, eng: &Engine, new_size: u64) -> Result<()> {
        self.inner.resize(eng, new_size).await
    }
    async fn grow_to(&self, eng: &Engine, new_size: u64) -> Result<()> {
        self.inner.grow_to(eng, new_size).await
    }
    fn written_to(&self, end: u64) {
        self.inner.written_to(end)
    }
    fn set_times(&self, atime: Option<(i64, u32)>, mtime: Option<(i64, u32)>) -> Result<()> {
        self.inner.set_times(atime, mtime)
    }
    fn queue_stopping(&self) {
        self.inner.queue_stopping()
    }
    fn queue_ended(&self) {
        self.inner.queue_ended()
    }
    fn trouble(&self) -> Option<String> {
        self.inner.trouble()
    }
    fn drop_unused(&self) {
        self.inner.drop_unused()
    }
    fn stats(&self) -> crate::BackendStats {
        self.inner.stats()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rules_parse() {
        assert_eq!(
            "write:3:eio".parse(),
            Ok(FaultRule {
                op: FaultOp::Write,
                nth: 3,
                action: FaultAction::Fail(libc::EIO)
            })
        );
        assert_eq!(
            "read:10:delay=250ms".parse(),
            Ok(FaultRule {
                op: FaultOp::Read,
                nth: 10,
                action: FaultAction::Delay(Duration::from_millis(250))
            })
        );
        assert_eq!(
            "flush:1:enospc".parse::<FaultRule>().map(|r| r.action),
            Ok(FaultAction::Fail(libc::ENOSPC))
        );
        assert_eq!(
            "read:*:delay=2ms".parse::<FaultRule>().map(|r| r.nth),
            Ok(EVERY)
        );
        for bad in [
            "",
            "write",
            "write:3",
            "write:0:eio",
            "write:x:eio",
            "trim:1:eio",
            "read:1:boom",
            "read:1:delay=5",
            "read:1:eio:more",
        ] {
            assert!(bad.parse::<FaultRule>().is_err(), "{bad:?} parsed");
        }
    }

    #[test]
    fn a_rule_for_every_call_hits_each_one() {
        let plan = Plan {
            rules: vec!["read:*:eio".parse().unwrap()],
            calls: Default::default(),
        };
        for _ in 0..3 {
            assert_eq!(plan.hit(FaultOp::Read), Some(FaultAction::Fail(libc::EIO)));
        }
        assert_eq!(plan.hit(FaultOp::Write), None);
    }

    #[test]
    fn only_the_nth_call_of_its_operation_is_hit() {
        let plan = Plan {
            rules: vec![
                "write:2:eio".parse().unwrap(),
                "read:1:enospc".parse().unwrap(),
            ],
            calls: Default::default(),
        };
        assert_eq!(plan.hit(FaultOp::Write), None);
        assert_eq!(plan.hit(FaultOp::Flush), None);
        assert_eq!(plan.hit(FaultOp::Write), Some(FaultAction::Fail(libc::EIO)));
        assert_eq!(plan.hit(FaultOp::Write), None);
        assert_eq!(
            plan.hit(FaultOp::Read),
            Some(FaultAction::Fail(libc::ENOSPC))
        );
        assert_eq!(plan.hit(FaultOp::Read), None);
    }
}
