#!/usr/bin/env bash
cd /app
printf 'for i in range(1, 16):\n    print("FizzBuzz" if i %% 15 == 0 else "Fizz" if i %% 3 == 0 else "Buzz" if i %% 5 == 0 else i)\n' > fizzbuzz.py
