"""Golden stores: exact bytes that documents show, committed so that tests read them."""
