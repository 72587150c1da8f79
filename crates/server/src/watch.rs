//! The stop protocol of a queue's watcher, as a pure function: what the watcher does at each
//! turn once a stop was asked, from what the queue and its crew look like then. The task that
//! runs it (in [`crate::queue`]) only observes, acts and waits, so every case of the protocol,
//! the ones that once lost a request or hung a stop included, is a unit test here.
//!
//! The cases come from io_uring crews ([`crate::Crew`]): the kernel delivers a request to the
//! thread of its CPU, which may hand it to a sibling. While it travels it is in no queue's count,
//! so a thread that is quiet is not yet done: the owner aborts the connection once every thread
//! says quiet, and a request in transit would be lost with it. And a thread that answered a
//! request handed to it must release it to the crew (after its reply is submitted), or its
//! sender waits for good.

/// What the watcher sees at one turn.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Seen {
    /// Every request taken here is answered, and no read can deliver another.
    pub quiet: bool,
    /// No request handed between the crew's threads waits for an answer (always, outside a
    /// crew, or once the crew closed).
    pub drained: bool,
    /// Requests handed here and answered while stopping, not yet released to the crew.
    pub answered_abroad: usize,
    /// No entry is left that another thread could hand here (always, outside a crew).
    pub closed: bool,
}

/// Where the watcher stands in the protocol.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    /// Asked to stop, not yet reported quiet.
    Quieting,
    /// Reported quiet; still releasing requests siblings hand here until the crew closes.
    Reported,
    /// Nothing is left to do.
    Done,
}

/// What the watcher does at one turn, in this order, and where it stands after.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Turn {
    /// Make the kernel take the replies queued so far (before a release or a report: the
    /// owner may abort the connection as soon as it hears quiet).
    pub submit: bool,
    /// Release the requests answered here to the crew. The turn is then taken again at once
    /// (the release may have drained the crew), as after a change of phase.
    pub release: bool,
    /// Tell the owner the queue is quiet.
    pub report: bool,
    /// The phase after the turn.
    pub next: Phase,
}

impl Turn {
    fn wait(phase: Phase) -> Turn {
        Turn {
            submit: false,
            release: false,
            report: false,
            next: phase,
        }
    }

    fn release(phase: Phase) -> Turn {
        Turn {
            submit: true,
            release: true,
            report: false,
            next: phase,
        }
    }
}

/// The watcher's turn in `phase` when it sees `seen`. A turn that neither releases nor changes
/// the phase waits for the next wake: a request answered here, the queue going quiet, the last release of
/// a migrant anywhere in the crew, or the crew closing.
pub fn turn(phase: Phase, seen: Seen) -> Turn {
    match phase {
        Phase::Done => Turn::wait(Phase::Done),
        Phase::Quieting if !seen.quiet => Turn::wait(Phase::Quieting),
        Phase::Quieting if seen.answered_abroad > 0 => Turn::release(Phase::Quieting),
        // Quiet, but a request travels between threads (maybe to here): not quiet yet.
        Phase::Quieting if !seen.drained => Turn {
            submit: true,
            ..Turn::wait(Phase::Quieting)
        },
        Phase::Quieting => Turn {
            submit: true,
            release: false,
            report: true,
            next: Phase::Reported,
        },
        Phase::Reported if seen.closed => Turn::wait(Phase::Done),
        // A sibling that had not stopped yet handed one more here: its sender waits for it.
        Phase::Reported if seen.quiet && seen.answered_abroad > 0 => Turn::release(Phase::Reported),
        Phase::Reported => Turn::wait(Phase::Reported),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seen(quiet: bool, drained: bool, answered_abroad: usize, closed: bool) -> Seen {
        Seen {
            quiet,
            drained,
            answered_abroad,
            closed,
        }
    }

    #[test]
    fn a_lone_queue_reports_once_quiet_then_ends() {
        let alone = |quiet| seen(quiet, true, 0, true);
        assert_eq!(
            turn(Phase::Quieting, alone(false)),
            Turn::wait(Phase::Quieting)
        );
        let t = turn(Phase::Quieting, alone(true));
        assert!(t.submit && t.report && !t.release);
        assert_eq!(t.next, Phase::Reported);
        assert_eq!(turn(Phase::Reported, alone(true)).next, Phase::Done);
    }

    /// A request in transit to or from this thread: quiet here, but reporting now would let the
    /// owner abort the connection under it.
    #[test]
    fn no_report_while_a_request_travels_between_threads() {
        let t = turn(Phase::Quieting, seen(true, false, 0, false));
        assert!(!t.report && !t.release);
        assert_eq!(t.next, Phase::Quieting);
    }

    /// Requests handed here and answered are released before anything is reported, and the
    /// turn is taken again: the release may have been the last in transit.
    #[test]
    fn answered_migrants_are_released_first_then_the_queue_reports() {
        let t = turn(Phase::Quieting, seen(true, false, 2, false));
        assert!(t.submit && t.release && !t.report);
        assert_eq!(t.next, Phase::Quieting);
        let t = turn(Phase::Quieting, seen(true, true, 0, false));
        assert!(t.submit && t.report);
        assert_eq!(t.next, Phase::Reported);
    }

    /// The case that hung a stop: a thread that had reported stopped releasing, and a sibling
    /// that handed it one more request waited for good. After the report, releasing goes on
    /// until the crew closes, and nothing is reported twice.
    #[test]
    fn after_the_report_requests_handed_here_are_still_released() {
        let t = turn(Phase::Reported, seen(true, false, 1, false));
        assert!(t.submit && t.release && !t.report);
        assert_eq!(t.next, Phase::Reported);
        // Not quiet yet (the request is still being answered): wait, do not release early.
        assert_eq!(
            turn(Phase::Reported, seen(false, false, 1, false)),
            Turn::wait(Phase::Reported)
        );
        assert_eq!(
            turn(Phase::Reported, seen(true, true, 0, false)),
            Turn::wait(Phase::Reported)
        );
        assert_eq!(
            turn(Phase::Reported, seen(true, true, 0, true)).next,
            Phase::Done
        );
    }

    /// Two threads of a crew run the protocol against one transit count: B hands a request to A,
    /// A answers it, both go quiet in either order. Each reports exactly once, and only once
    /// nothing is in transit; A's release is what lets B report.
    #[test]
    fn two_threads_of_a_crew_report_once_each_and_only_when_drained() {
        struct Thread {
            phase: Phase,
            busy: usize,
            answered_abroad: usize,
            reports: usize,
        }
        let new = || Thread {
            phase: Phase::Quieting,
            busy: 0,
            answered_abroad: 0,
            reports: 0,
        };
        for a_first in [true, false] {
            let (mut a, mut b) = (new(), new());
            // B handed one request to A; A took it.
            let mut transit = 1;
            a.busy = 1;
            let step = |t: &mut Thread, transit: &mut usize| loop {
                let s = seen(t.busy == 0, *transit == 0, t.answered_abroad, false);
                let turned = turn(t.phase, s);
                if turned.release {
                    *transit -= t.answered_abroad;
                    t.answered_abroad = 0;
                }
                t.reports += turned.report as usize;
                let moved = turned.next != t.phase;
                t.phase = turned.next;
                if !(turned.release || moved) {
                    break;
                }
            };
            if a_first {
                step(&mut a, &mut transit);
                step(&mut b, &mut transit);
                assert_eq!(
                    (a.reports, b.reports),
                    (0, 0),
                    "A is busy, B's request travels"
                );
            } else {
                step(&mut b, &mut transit);
                step(&mut a, &mut transit);
                assert_eq!(
                    (a.reports, b.reports),
                    (0, 0),
                    "A is busy, B's request travels"
                );
            }
            // A answers it: quiet, with one to release.
            a.busy = 0;
            a.answered_abroad = 1;
            step(&mut b, &mut transit);
            assert_eq!(b.reports, 0, "B waits while A holds the answered request");
            step(&mut a, &mut transit);
            assert_eq!((a.reports, transit), (1, 0), "A released, then reported");
            // The last release wakes B's watcher.
            step(&mut b, &mut transit);
            assert_eq!(b.reports, 1);
            for t in [&mut a, &mut b] {
                step(t, &mut transit);
                assert_eq!(t.reports, 1, "reported once");
                assert_eq!(t.phase, Phase::Reported);
            }
        }
    }
}
