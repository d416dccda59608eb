"""What each request cost and saved: the request record, the usage ledger and its stores, `mergebroker report`."""
