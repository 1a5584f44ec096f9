//! Unit tests of launching a binary: its `listening` line, timeouts, output kept for failure
//! reports, stopping it.

use std::time::Duration;

use super::*;

const WAIT: Duration = Duration::from_secs(20);

fn sh(script: &str) -> Launch {
    Launch::new("/bin/sh").args(["-c", script]).name("svc")
}

#[test]
fn the_listening_line_is_read_back_with_its_fields() {
    let p = sh("echo 'INFO a log line on stderr mentions listening' >&2; \
         echo 'svc listening rpc=127.0.0.1:41234 admin=127.0.0.1:9003'; exec sleep 30")
    .spawn()
    .unwrap();
    let f = p.wait_announce("rpc", WAIT).unwrap();
    assert_eq!(f["rpc"], "127.0.0.1:41234");
    assert_eq!(f["admin"], "127.0.0.1:9003");
    // The stderr line has no rpc=, so it was not taken for the announcement; it is kept with
    // the output. Stderr is read by its own thread, so wait for it rather than race it.
    assert!(
        p.wait_for_line("a log line", WAIT)
            .unwrap()
            .contains("listening")
    );
}

#[test]
fn a_child_that_dies_first_is_reported_with_its_status_and_last_words() {
    let p = sh("echo 'cannot bind 127.0.0.1:1' >&2; exit 3")
        .spawn()
        .unwrap();
    let e = p.wait_announce("rpc", WAIT).unwrap_err();
    let msg = e.to_string();
    assert!(matches!(e, LaunchError::Ended { .. }), "{msg}");
    assert!(
        msg.starts_with(
            "svc exited with exit status: 3 before it printed its listening line (with rpc=)"
        ),
        "{msg}"
    );
    assert!(msg.contains("  cannot bind 127.0.0.1:1"), "{msg}");
}

#[test]
fn a_line_printed_just_before_exit_is_still_found() {
    let p = sh("echo 'refused: --tenant_id=x'; exit 1").spawn().unwrap();
    assert_eq!(p.exit_within(WAIT).map(|s| s.code()), Some(Some(1)));
    assert_eq!(
        p.wait_for_line("refused", WAIT).unwrap(),
        "refused: --tenant_id=x"
    );
}

#[test]
fn after_an_exit_the_output_holds_every_line_the_child_printed() {
    // A burst larger than the pipe's buffer: the reader is still working through it when the
    // child is reaped.
    let p = sh("yes line | head -n 100000; echo 'refused: offload mismatch' >&2; exit 1")
        .spawn()
        .unwrap();
    assert_eq!(p.exit_within(WAIT).map(|s| s.code()), Some(Some(1)));
    let out = p.output();
    assert!(out.contains("refused: offload mismatch"), "{}", p.tail());
    assert_eq!(out.lines().filter(|l| *l == "line").count(), 100_000);
}

#[test]
fn a_silent_child_times_out_naming_what_was_awaited() {
    let p = sh("echo starting; exec sleep 30").spawn().unwrap();
    let e = p
        .wait_announce("transfer", Duration::from_millis(300))
        .unwrap_err();
    let msg = e.to_string();
    assert!(matches!(e, LaunchError::Timeout { .. }), "{msg}");
    assert!(
        msg.contains("(with transfer=)") && msg.contains("  starting"),
        "{msg}"
    );
}

#[test]
fn a_bounded_buffer_keeps_the_tail_and_still_finds_the_listening_line() {
    let p = sh(
        "i=0; while [ $i -lt 200 ]; do echo line $i; i=$((i+1)); done; \
         echo 'svc listening addr=127.0.0.1:7'; echo after; exec sleep 30",
    )
    .keep_lines(5)
    .spawn()
    .unwrap();
    p.wait_for_line("after", WAIT).unwrap();
    assert_eq!(
        p.wait_announce("addr", WAIT).unwrap()["addr"],
        "127.0.0.1:7"
    );
    let out = p.output();
    assert_eq!(out.lines().count(), 5, "{out}");
    assert!(out.ends_with("after") && !out.contains("line 100"), "{out}");
}

#[test]
fn the_child_gets_its_arguments_and_environment() {
    let p = Launch::new("/bin/sh")
        .args(["-c", "echo \"$LUNAKV_LAUNCH_TEST $0\"", "arg0"])
        .env("LUNAKV_LAUNCH_TEST", "from-env")
        .spawn()
        .unwrap();
    assert_eq!(p.wait_for_line("from-env", WAIT).unwrap(), "from-env arg0");
    assert_eq!(p.name(), "sh");
}

#[test]
fn terminate_lets_the_child_exit_cleanly_and_drop_kills() {
    let p = sh("trap 'exit 0' TERM; echo ready; while :; do sleep 0.05; done")
        .spawn()
        .unwrap();
    p.wait_for_line("ready", WAIT).unwrap();
    assert!(p.terminate(WAIT).unwrap().success());
    assert!(!p.alive());

    let p = sh("exec sleep 30").spawn().unwrap();
    let proc_dir = format!("/proc/{}", p.pid());
    assert!(std::path::Path::new(&proc_dir).exists());
    drop(p);
    assert!(
        !std::path::Path::new(&proc_dir).exists(),
        "the child outlived its Process"
    );
}

#[test]
fn a_missing_binary_names_the_path_and_the_fix() {
    let dir = tempfile::tempdir().unwrap();
    let e = find_bin(
        dir.path(),
        "lunakv-master",
        "build it with `cargo build --bins`",
    )
    .unwrap_err();
    assert_eq!(
        e.to_string(),
        format!(
            "lunakv-master not found at {}: build it with `cargo build --bins`",
            dir.path().join("lunakv-master").display()
        )
    );
    let e = Launch::new(dir.path().join("nope")).spawn().err().unwrap();
    assert!(e.to_string().starts_with("cannot start "), "{e}");
}

#[test]
fn kept_lines_lose_their_colours_in_reports() {
    assert_eq!(
        process::strip_ansi("\x1b[2mts\x1b[0m \x1b[32m INFO\x1b[0m up"),
        "ts  INFO up"
    );
    assert_eq!(process::strip_ansi("plain"), "plain");
}
