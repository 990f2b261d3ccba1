#!/usr/bin/env bash
cd /app
printf 'hello world\n' > hello.txt
