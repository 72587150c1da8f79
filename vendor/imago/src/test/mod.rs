//! Shared helpers for tests.

pub mod mem_storage;
