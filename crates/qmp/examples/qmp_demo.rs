//! A QMP server with toy commands, for trying fusex-qmp with any QMP client and for the
//! end-to-end test against QEMU's own client library (`tests/qemu_client.rs`):
//!
//! ```sh
//! cargo run -p fusex-qmp --example qmp_demo -- /tmp/demo.sock
//! # another shell, with qemu.qmp installed:  qmp-shell /tmp/demo.sock
//! ```
//!
//! Commands: `demo-echo` (`message`: string, `repeat`: optional uint8; returns the message
//! repeated), `demo-event` (`name`: optional string; emits `DEMO_EVENT` with a counter to every
//! client), `demo-fail` (always fails with `DeviceNotFound`) and `quit` (stops the server, which
//! removes its socket). The process exits when the server stops.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

use qmp::{
    parse_args, Dispatcher, ErrorClass, EventBus, QmpError, Server, ServerConfig, ShutdownHandle,
};
use serde::Deserialize;
use serde_json::{json, Value};

/// `demo-echo`'s arguments.
#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
struct Echo {
    message: String,
    #[serde(default)]
    repeat: Option<u8>,
}

/// `demo-event`'s arguments.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct EventArgs {
    #[serde(default)]
    name: Option<String>,
}

/// Commands without arguments.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct NoArgs {}

struct Demo {
    events: EventBus,
    count: AtomicU64,
    stop: OnceLock<ShutdownHandle>,
}

impl Dispatcher for Demo {
    fn commands(&self) -> Vec<String> {
        ["demo-echo", "demo-event", "demo-fail", "quit"]
            .map(String::from)
            .to_vec()
    }

    fn dispatch(&self, name: &str, arguments: Value) -> Result<Value, QmpError> {
        match name {
            "demo-echo" => {
                let a: Echo = parse_args(arguments)?;
                Ok(json!({"message": a.message.repeat(usize::from(a.repeat.unwrap_or(1)))}))
            }
            "demo-event" => {
                let a: EventArgs = parse_args(arguments)?;
                let n = self.count.fetch_add(1, Ordering::Relaxed) + 1;
                let mut data = json!({"count": n});
                if let Some(name) = a.name {
                    data["name"] = json!(name);
                }
                self.events.emit("DEMO_EVENT", Some(data));
                Ok(json!({}))
            }
            "demo-fail" => {
                let _: NoArgs = parse_args(arguments)?;
                Err(QmpError::new(
                    ErrorClass::DeviceNotFound,
                    "Demo device 'nothing' not found",
                ))
            }
            "quit" => {
                let _: NoArgs = parse_args(arguments)?;
                if let Some(h) = self.stop.get() {
                    h.shutdown();
                }
                Ok(json!({}))
            }
            _ => Err(QmpError::command_not_found(name)),
        }
    }
}

fn main() {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_writer(std::io::stderr)
        .init();
    let Some(path) = std::env::args().nth(1) else {
        eprintln!("usage: qmp_demo SOCKET");
        std::process::exit(2);
    };
    let events = EventBus::new();
    let demo = Arc::new(Demo {
        events: events.clone(),
        count: AtomicU64::new(0),
        stop: OnceLock::new(),
    });
    let config = ServerConfig {
        events,
        ..ServerConfig::default()
    };
    let server = match Server::bind(&path, demo.clone(), config) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("qmp_demo: error: {e}");
            std::process::exit(1);
        }
    };
    let _ = demo.stop.set(server.shutdown_handle());
    if let Err(e) = server.run() {
        eprintln!("qmp_demo: error: {e}");
        std::process::exit(1);
    }
}
