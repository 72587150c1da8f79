//! Misuse: naming the engine's submission entry type from outside the crate.
//!
//! `engine::Sqe` is crate-private (E0603): only the typed operations of the engine make entries.

fn main() {
    let _: Option<engine::Sqe> = None;
}
