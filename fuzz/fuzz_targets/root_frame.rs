//! The root_frame decoder fed whole and cut into pieces (see the included module).
#![no_main]

#[path = "../../crates/rallypoint-proto/tests/stream_cut/mod.rs"]
mod stream_cut;

libfuzzer_sys::fuzz_target!(|data: &[u8]| stream_cut::check_input(stream_cut::Target::RootFrame, data));
