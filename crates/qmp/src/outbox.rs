//! A client's outgoing lines. Replies are written by the client's own thread, as it makes them,
//! when nothing is queued ahead of them; events (and replies that find lines queued) go through a
//! bounded queue that the client's writer thread drains. A hand-off to the writer for every reply
//! cost two thread switches per command, a fifth of the work of a daemon adding and removing
//! exports; events keep the queue, so an emitter never blocks on a slow client.
//!
//! Order: a line queued before a reply is written before it (the reply is written inline only
//! while the queue is empty and the writer holds no line it has not written yet).

use std::io::Write;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender, TrySendError};
use std::sync::{Arc, Mutex};

use crate::events::{Offered, Queue};

/// What both sides share: the stream and how many lines are queued or being written.
struct Shared<W> {
    out: Mutex<W>,
    /// Lines queued and not yet written (counted before they are queued, uncounted once
    /// written).
    pending: AtomicUsize,
}

/// The sending side, held by the client's thread and the event bus.
pub struct Outbox<W> {
    queue: SyncSender<Arc<str>>,
    shared: Arc<Shared<W>>,
}

/// The writer thread's side: the queue, drained in order.
pub struct Drain<W> {
    queue: Receiver<Arc<str>>,
    shared: Arc<Shared<W>>,
}

/// An outbox over `out` with room for `len` queued lines, and its drain.
pub fn outbox<W: Write>(out: W, len: usize) -> (Arc<Outbox<W>>, Drain<W>) {
    let (tx, rx) = sync_channel(len.max(1));
    let shared = Arc::new(Shared {
        out: Mutex::new(out),
        pending: AtomicUsize::new(0),
    });
    (
        Arc::new(Outbox {
            queue: tx,
            shared: shared.clone(),
        }),
        Drain { queue: rx, shared },
    )
}

impl<W: Write> Outbox<W> {
    /// Sends a reply: written now if nothing is queued ahead of it, else queued (waiting for
    /// room, as a reply to a client that does not read must). False once the client is gone.
    pub fn reply(&self, line: Arc<str>) -> bool {
        if self.shared.pending.load(Ordering::Acquire) == 0 {
            let mut out = self.shared.out.lock().unwrap_or_else(|p| p.into_inner());
            // Checked again under the lock: the writer holds it while it writes a queued line.
            if self.shared.pending.load(Ordering::Acquire) == 0 {
                return out
                    .write_all(line.as_bytes())
                    .and_then(|()| out.flush())
                    .is_ok();
            }
        }
        self.shared.pending.fetch_add(1, Ordering::AcqRel);
        let sent = self.queue.send(line).is_ok();
        if !sent {
            self.shared.pending.fetch_sub(1, Ordering::AcqRel);
        }
        sent
    }
}

impl<W: Write + Send> Queue for Arc<Outbox<W>> {
    fn offer(&self, line: Arc<str>) -> Offered {
        self.shared.pending.fetch_add(1, Ordering::AcqRel);
        let offered = match self.queue.try_send(line) {
            Ok(()) => return Offered::Queued,
            Err(TrySendError::Full(back)) => Offered::Full(back),
            Err(TrySendError::Disconnected(_)) => Offered::Gone,
        };
        self.shared.pending.fetch_sub(1, Ordering::AcqRel);
        offered
    }
}

impl<W: Write> Drain<W> {
    /// Writes queued lines until every outbox is gone or the stream fails.
    pub fn run(self) {
        for line in self.queue {
            let written = {
                let mut out = self.shared.out.lock().unwrap_or_else(|p| p.into_inner());
                out.write_all(line.as_bytes()).and_then(|()| out.flush())
            };
            self.shared.pending.fetch_sub(1, Ordering::AcqRel);
            if written.is_err() {
                break;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A stream whose bytes the test reads back.
    #[derive(Clone, Default)]
    struct Sink(Arc<Mutex<Vec<u8>>>);

    impl Write for Sink {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn a_reply_with_nothing_queued_is_written_at_once() {
        let sink = Sink::default();
        let (ob, _drain) = outbox(sink.clone(), 4);
        assert!(ob.reply(Arc::from("r1\n")));
        assert_eq!(&*sink.0.lock().unwrap(), b"r1\n");
    }

    #[test]
    fn a_reply_waits_behind_queued_lines() {
        let sink = Sink::default();
        let (ob, drain) = outbox(sink.clone(), 4);
        assert!(matches!(ob.offer(Arc::from("e1\n")), Offered::Queued));
        // The event is queued and not written: the reply goes behind it.
        assert!(ob.reply(Arc::from("r1\n")));
        assert!(sink.0.lock().unwrap().is_empty());
        drop(ob);
        drain.run();
        assert_eq!(&*sink.0.lock().unwrap(), b"e1\nr1\n");
    }

    #[test]
    fn a_full_queue_hands_the_line_back() {
        let (ob, drain) = outbox(Sink::default(), 1);
        assert!(matches!(ob.offer(Arc::from("a")), Offered::Queued));
        assert!(matches!(ob.offer(Arc::from("b")), Offered::Full(l) if &*l == "b"));
        drop(drain);
        assert!(matches!(ob.offer(Arc::from("c")), Offered::Gone));
        assert!(
            !ob.reply(Arc::from("r")),
            "a reply behind a line that will never be written"
        );
    }
}
