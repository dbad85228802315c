//! kura-sim
