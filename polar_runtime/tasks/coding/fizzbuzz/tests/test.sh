#!/usr/bin/env bash
# reward = the fraction of fizzbuzz.py's 15 lines that are right
cd /app || exit 2
mkdir -p /logs/verifier
# partial credit: the fraction of the 15 lines that are right
python3 fizzbuzz.py 2>/dev/null | python3 -c "
import sys
want = ['FizzBuzz' if i % 15 == 0 else 'Fizz' if i % 3 == 0 else 'Buzz' if i % 5 == 0 else str(i) for i in range(1, 16)]
got = sys.stdin.read().split()
print(sum(a == b for a, b in zip(got, want)) / 15)" > /logs/verifier/reward.txt
