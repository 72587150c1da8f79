//! Broadcasting events to every client in command mode.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{SyncSender, TrySendError};
use std::sync::{Arc, Mutex};

use serde_json::Value;

use crate::protocol::Event;

/// What offering a line to a client's queue did.
#[derive(Debug)]
pub enum Offered {
    /// It is queued: the client's writer sends it.
    Queued,
    /// The queue is full (the client stopped reading); the line comes back.
    Full(Arc<str>),
    /// The client is gone.
    Gone,
}

/// A client's outgoing queue, as the bus sees it: offering never blocks.
pub trait Queue: Send {
    /// Queues `line` if there is room.
    fn offer(&self, line: Arc<str>) -> Offered;
}

impl Queue for SyncSender<Arc<str>> {
    fn offer(&self, line: Arc<str>) -> Offered {
        match self.try_send(line) {
            Ok(()) => Offered::Queued,
            Err(TrySendError::Full(back)) => Offered::Full(back),
            Err(TrySendError::Disconnected(_)) => Offered::Gone,
        }
    }
}

/// A client's way to get events: its outgoing queue, and how to cut it off when the queue is
/// full (a client that stops reading must not hold memory without bound or stall the emitter).
struct Subscriber {
    id: u64,
    queue: Box<dyn Queue>,
    kick: Box<dyn Fn() + Send>,
}

/// The event channel shared by the embedder and the server: clone it into the dispatcher (or
/// anywhere else) and [`EventBus::emit`] reaches every client that has finished capabilities
/// negotiation, as QEMU's monitors do. Emitting never blocks.
#[derive(Clone, Default)]
pub struct EventBus {
    inner: Arc<Mutex<Vec<Subscriber>>>,
    next_id: Arc<AtomicU64>,
}

/// A subscription's key, to remove it when its client goes away.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SubscriberId(u64);

impl EventBus {
    /// A bus with no clients.
    pub fn new() -> Self {
        Self::default()
    }

    /// Sends `name` with `data` to every subscribed client, stamped now. Returns how many
    /// clients it was queued for. A client whose queue is full is disconnected (and logged):
    /// it has stopped reading, and QMP has no way to tell it an event was lost.
    pub fn emit(&self, name: &str, data: Option<Value>) -> usize {
        self.emit_event(&Event::new(name, data))
    }

    /// Sends an already built event.
    pub fn emit_event(&self, event: &Event) -> usize {
        let line: Arc<str> = Arc::from(format!("{}\n", event.to_json()));
        let mut subs = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        let mut sent = 0;
        subs.retain(|s| match s.queue.offer(line.clone()) {
            Offered::Queued => {
                sent += 1;
                true
            }
            Offered::Full(_) => {
                tracing::warn!(client = s.id, event = %event.name, "QMP client does not read its events: disconnecting it");
                (s.kick)();
                false
            }
            Offered::Gone => false,
        });
        sent
    }

    /// Adds a client's queue; `kick` closes its connection if the queue overflows.
    pub fn subscribe(
        &self,
        queue: impl Queue + 'static,
        kick: Box<dyn Fn() + Send>,
    ) -> SubscriberId {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let mut subs = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        subs.push(Subscriber {
            id,
            queue: Box::new(queue),
            kick,
        });
        SubscriberId(id)
    }

    /// Queues `first` (the reply that ended the client's negotiation) and adds the client's
    /// queue in one step under the bus's lock, so the client gets no event before that reply and
    /// misses none emitted after it. While the queue is full (the client is not reading) this
    /// waits, as queueing any reply does; a queue whose reader is gone is not added.
    pub fn subscribe_after(
        &self,
        queue: impl Queue + 'static,
        kick: Box<dyn Fn() + Send>,
        first: Arc<str>,
    ) -> Option<SubscriberId> {
        let queue: Box<dyn Queue> = Box::new(queue);
        let mut first = first;
        loop {
            {
                let mut subs = self.inner.lock().unwrap_or_else(|p| p.into_inner());
                match queue.offer(first) {
                    Offered::Queued => {
                        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
                        subs.push(Subscriber { id, queue, kick });
                        return Some(SubscriberId(id));
                    }
                    Offered::Gone => return None,
                    Offered::Full(back) => first = back,
                }
            }
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
    }

    /// Removes a client's queue (it disconnected).
    pub fn unsubscribe(&self, id: SubscriberId) {
        let mut subs = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        subs.retain(|s| s.id != id.0);
    }

    /// How many clients receive events now.
    pub fn subscribers(&self) -> usize {
        self.inner.lock().unwrap_or_else(|p| p.into_inner()).len()
    }
}

impl std::fmt::Debug for EventBus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EventBus")
            .field("subscribers", &self.subscribers())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicBool;
    use std::sync::mpsc::sync_channel;

    #[test]
    fn events_reach_every_subscriber_once() {
        let bus = EventBus::new();
        let (tx1, rx1) = sync_channel(4);
        let (tx2, rx2) = sync_channel(4);
        bus.subscribe(tx1, Box::new(|| {}));
        let id2 = bus.subscribe(tx2, Box::new(|| {}));
        assert_eq!(bus.emit("E", Some(serde_json::json!({"a": 1}))), 2);
        let line = rx1.try_recv().unwrap();
        let v: Value = serde_json::from_str(&line).unwrap();
        assert_eq!(v["event"], "E");
        assert_eq!(v["data"]["a"], 1);
        assert!(v["timestamp"]["seconds"].as_u64().unwrap() > 0);
        assert!(rx2.try_recv().is_ok());
        bus.unsubscribe(id2);
        assert_eq!(bus.emit("F", None), 1);
        assert!(rx2.try_recv().is_err());
    }

    #[test]
    fn subscribe_after_queues_the_reply_first() {
        let bus = EventBus::new();
        let (tx, rx) = sync_channel(2);
        let id = bus.subscribe_after(tx, Box::new(|| {}), Arc::from("reply\n"));
        assert!(id.is_some());
        bus.emit("E", None);
        assert_eq!(&*rx.try_recv().unwrap(), "reply\n");
        assert!(rx.try_recv().unwrap().contains("\"event\":\"E\""));
        let (tx, rx) = sync_channel(1);
        drop(rx);
        assert!(bus
            .subscribe_after(tx, Box::new(|| {}), Arc::from("x"))
            .is_none());
    }

    #[test]
    fn a_full_queue_kicks_its_client_and_a_gone_one_is_dropped() {
        let bus = EventBus::new();
        let kicked = Arc::new(AtomicBool::new(false));
        let k = kicked.clone();
        let (tx, _rx) = sync_channel(1);
        bus.subscribe(tx, Box::new(move || k.store(true, Ordering::SeqCst)));
        let (tx2, rx2) = sync_channel(1);
        bus.subscribe(tx2, Box::new(|| {}));
        drop(rx2);
        assert_eq!(bus.emit("A", None), 1);
        assert_eq!(bus.subscribers(), 1, "the disconnected queue is gone");
        assert_eq!(bus.emit("B", None), 0);
        assert!(kicked.load(Ordering::SeqCst));
        assert_eq!(bus.subscribers(), 0);
    }
}
