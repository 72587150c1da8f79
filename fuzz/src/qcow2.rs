//! The qcow2 integrity pass (`backend::qcow2::check`) over arbitrary image bytes: it must answer
//! (never panic, never read past the input), and its verdict must not depend on how many host
//! clusters one pass counts at a time.

use backend::qcow2::check::{check, check_windowed, CheckError};

/// What one input gave, for the seed tests.
#[derive(Debug, PartialEq, Eq)]
pub enum Verdict {
    /// The image passed.
    Clean,
    /// The image is damaged.
    Damaged,
    /// A read failed (a structure past the end of the input).
    Unreadable,
}

/// Runs the pass over `data` twice (one window, and windows of 3 clusters) and checks both agree.
pub fn run(data: &[u8]) -> Verdict {
    let whole = verdict(check(data));
    let split = verdict(check_windowed(data, 3));
    assert_eq!(whole, split, "the verdict depends on the window");
    whole
}

fn verdict<T>(r: Result<T, CheckError>) -> Verdict {
    match r {
        Ok(_) => Verdict::Clean,
        Err(CheckError::Damaged { first, .. }) => {
            assert!(!first.is_empty() && !first.contains('\n'));
            Verdict::Damaged
        }
        Err(CheckError::Io(_)) => Verdict::Unreadable,
    }
}
