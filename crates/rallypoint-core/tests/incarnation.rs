//! Who may speak for a rank and a job: incarnations, takeovers, job resets, the
//! reconnect grace and resumed sessions whose re-sent requests never count twice.
//!
//! Every case runs twice: with barrier calls made one at a time, and with each made
//! as a node agent's run (held in a record, `Engine::handle_calls_from`), whose
//! calls a resumed session must find as it finds its kept replies.

mod one_at_a_time {
    const HELD: bool = false;
    include!("incarnation/cases.rs");
}

mod held_in_records {
    const HELD: bool = true;
    include!("incarnation/cases.rs");
}
