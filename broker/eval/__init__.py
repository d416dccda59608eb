"""`mergebroker eval`: merged answers measured against alone answers on one upstream."""
