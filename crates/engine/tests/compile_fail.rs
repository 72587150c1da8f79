//! Compile-fail tests: misuses of the engine's buffer and ring API that must be rejected by the
//! compiler, not caught at run time. Each program in `tests/compile_fail/` shows one misuse; its
//! `.stderr` snapshot pins the error it must fail with (regenerate with `TRYBUILD=overwrite`, then
//! review that each error is still the intended one).

#[test]
fn misuses_do_not_compile() {
    let t = trybuild::TestCases::new();
    t.compile_fail("tests/compile_fail/*.rs");
}
