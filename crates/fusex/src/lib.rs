//! fusex as a library: what the `fusex` binary runs, shaped so that a program embedding it (a
//! management agent, a test harness) drives the same objects. An export is a
//! [`lifecycle::Prepared`] (its image opened, its mountpoint mounted) driven by a
//! [`lifecycle::Supervisor`] through its life (serve, stop, hand over, end); [`service`] holds
//! many of them in one process and answers QMP for them (`fusex serve`), and [`serve`] runs the
//! one-export commands (`fusex mount`, `fusex restart`, `fusex umount`).

mod affinity;
pub mod cli;
pub mod ctl;
pub mod daemon;
mod dirmode;
mod dirtable;
mod files;
pub mod generate;
pub mod lifecycle;
pub mod list;
pub mod logging;
mod memory;
mod metrics;
mod mount_control;
mod notify;
mod passthrough;
mod priority;
mod privileges;
mod qmp_client;
mod restart;
mod runtime;
pub mod serve;
pub mod service;
mod timeout;
pub mod top;
pub mod version;
pub mod watcher;
mod workers;
