//! kura-bench
