//! Cache-aware scheduling (see issue 4).
